"""Per-tenant token budgets (``CONVEYOR_TENANT_TOKENS_PER_MIN``), kept in Redis so every API
replica counts against the same minute.

A tenant is who sends the request (:func:`api.admission.client_id`: its API key's digest
when keys are configured, else its address). Its minute is a fixed window: one counter
per tenant per wall-clock minute (``conveyor:tenant:<tenant>:<minute>``, expiring after
two), which the request's prompt tokens enter as it is admitted (one small script: a
minute already spent answers **429** ``rate_limit_exceeded`` with ``Retry-After`` up to
the next minute and runs nothing) and its completion tokens as it ends. A request admitted
while the minute had room runs to its end, so a minute may end past its budget by what
the requests running in it make; the next minute starts from zero.

``conveyor_tenant_tokens_total{tenant,kind}`` counts each API key's prompt and completion
tokens on this API process (with several processes, /metrics sums them); tenants named by
address are not counted there (one series per client address would grow without bound).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NoReturn

import redis.asyncio as aioredis

from api.errors import OpenAIError
from api.metrics import ApiMetrics
from cluster.keys import KEY_PREFIX

log = logging.getLogger(__name__)

WINDOW_S = 60

# KEYS: the tenant's counter for this minute. ARGV: budget, prompt tokens, TTL (s).
# Returns the tokens used before this request, or -1 - used when the minute is spent.
CHARGE_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used >= tonumber(ARGV[1]) then return -1 - used end
redis.call('INCRBY', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return used
"""


def window_key(tenant: str, now: float) -> str:
    return f"{KEY_PREFIX}tenant:{tenant}:{int(now // WINDOW_S)}"


class TenantBudget:
    """The budget of ``tokens_per_min`` per tenant (0: none; then nothing touches Redis)."""

    def __init__(self, client: aioredis.Redis, tokens_per_min: int, metrics: ApiMetrics) -> None:
        self._r = client
        self.tokens_per_min = tokens_per_min
        self._metrics = metrics
        self._charge = client.register_script(CHARGE_LUA)
        self._pending: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: str, prompt_tokens: int) -> None:
        """Count ``prompt_tokens`` against the tenant's minute, or raise a 429 when it is
        spent already."""
        if self.tokens_per_min:
            now = time.time()
            used = int(await self._charge(keys=[window_key(tenant, now)],
                                          args=[self.tokens_per_min, prompt_tokens,
                                                2 * WINDOW_S]))  # fmt: skip
            if used < 0:
                self._refuse(used, prompt_tokens, now)
        if tenant.startswith("key:"):
            self._metrics.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)

    def _refuse(self, used: int, prompt_tokens: int, now: float) -> NoReturn:
        self._metrics.refused.labels("tenant_tokens").inc()
        wait = max(1, int(WINDOW_S - now % WINDOW_S + 0.999))
        raise OpenAIError(
            429,
            f"token budget spent for this minute: limit {self.tokens_per_min} tokens per "
            f"minute, used {-1 - used}, requested {prompt_tokens}; retry after {wait} s",
            "tokens",
            None,
            "rate_limit_exceeded",
            headers={"Retry-After": str(wait)},
        )

    def used(self, tenant: str, completion_tokens: int) -> None:
        """Count a finished request's ``completion_tokens`` (in the background: the
        response has ended)."""
        if completion_tokens <= 0:
            return
        if tenant.startswith("key:"):
            self._metrics.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)
        if not self.tokens_per_min:
            return
        task = asyncio.get_running_loop().create_task(self._add(tenant, completion_tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _add(self, tenant: str, tokens: int) -> None:
        key = window_key(tenant, time.time())
        try:
            pipe: Any = self._r.pipeline(transaction=False)
            pipe.incrby(key, tokens).expire(key, 2 * WINDOW_S)
            await pipe.execute()
        except Exception as e:  # noqa: BLE001 - the count is lost, the request is not
            log.warning("tenant %s: counting %d completion tokens failed: %s", tenant, tokens, e)
