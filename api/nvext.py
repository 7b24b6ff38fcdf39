"""What NVIDIA Dynamo's ``nvext`` asks of a response, beside the request fields
:class:`api.protocol.NvExt` maps onto vLLM's.

* ``extra_fields``: ``"worker_id"`` and ``"timing"`` put an ``nvext`` object on the
  response: on the body of a whole response, on each finish chunk of a stream. worker_id
  names the worker that prefilled the request and the one that decoded it (ids as this
  deployment names its workers; strings, where Dynamo's are numbers), and the encode
  worker where one ran. timing has Dynamo's fields: when the API received the request
  (epoch ms), the time to its chain's dispatch (``prefill_wait_time_ms``: checks,
  template, tokens, routing) and from there to the first token (``prefill_time_ms``),
  time to first token, total time, and the share of the prompt's blocks the prefilling
  worker held cached when it was routed (``kv_hit_rate``). Other names are ignored, as
  Dynamo ignores them.
* ``annotations``: ``"formatted_prompt"`` and ``"token_ids"`` stream as SSE events before
  the first chunk, as Dynamo's: ``event: <name>`` and the value, JSON-encoded, as an SSE
  comment (the prompt decoded from its tokens, special tokens kept, and its ids as JSON
  text). A whole response carries none, as Dynamo's.
* ``session_control``: a session's turns stick to the workers of its last turn while it
  lives (its ``timeout`` since its last turn); ``close`` ends it. A worker of the session
  that left is replaced by routing as usual. Dynamo also keeps a session's KV on its
  worker between turns; here KV-aware routing finds it there anyway, and the prefix
  cache keeps it while it is not evicted.
* Dynamo's routing headers: ``x-worker-instance-id`` pins the request (its decode
  worker), ``x-prefill-instance-id`` its prefill worker (:func:`pins`).
* ``agent_hints.speculative_prefill``: once a chat turn ended, the conversation with its
  answer (rendered as the next turn will start) is prefilled (:func:`warm`), so that the
  next turn finds it cached (a template that drops the thinking of past turns, for one,
  renders them differently from what was generated).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from api.errors import bad_request
from api.protocol import PIN_HEADER, NvExt, SessionControl
from api.runner import Runner, RunningRequest
from cluster.keys import session_key
from cluster.lora import LoraRef
from cluster.resp import as_str
from kvbm.protocol import Sampling
from tasks.modes import Mode

WORKER_HEADER = "x-worker-instance-id"  # Dynamo's: the decode (or only) worker
PREFILL_HEADER = "x-prefill-instance-id"  # Dynamo's: the prefill worker
ANNOTATIONS = ("formatted_prompt", "token_ids")  # those Dynamo's frontend answers
WARM_TIMEOUT_S = 60.0  # a warm-up still running by then has lost its race with the next turn

log = logging.getLogger(__name__)


def pins(
    worker_id: str | None, ext: NvExt | None, headers: Mapping[str, str], mode: Mode
) -> tuple[str | None, str | None]:
    """The request's pins: (the worker it runs on, or decodes on in P/D; the worker that
    prefills it in P/D). Dynamo's headers win over the body, as in Dynamo. In a mode
    without prefill workers the prefill pin is the worker's (one worker prefills and
    decodes); naming two different ones there is a 400."""
    pin = headers.get(WORKER_HEADER) or worker_id or headers.get(PIN_HEADER) or None
    prefill = headers.get(PREFILL_HEADER) or None
    if prefill is None and ext is not None and ext.prefill_worker_id is not None:
        prefill = str(ext.prefill_worker_id)
    if prefill is None or any(s.kv_transfer and s.optional for s in mode.stages):
        return pin, prefill
    if pin is not None and pin != prefill:
        raise bad_request(f"mode {mode.name!r} prefills and decodes on one worker: "
                          f"prefill_worker_id {prefill!r} and the worker pinned "
                          f"({pin!r}) must be the same", "nvext.prefill_worker_id",
                          "invalid_value")  # fmt: skip
    return prefill, None


def response_fields(ext: NvExt | None, runs: list[RunningRequest],
                    started: float) -> Callable[[], dict | None] | None:  # fmt: skip
    """What builds the response's ``nvext`` when it is due (None: none was asked for)."""
    fields = set(ext.extra_fields or ()) if ext is not None else set()
    if not fields & {"worker_id", "timing"}:
        return None
    received_ms = int((time.time() - (time.perf_counter() - started)) * 1000)

    def build() -> dict | None:
        out: dict = {}
        if "worker_id" in fields:
            out["worker_id"] = dict(runs[0].workers)
        if "timing" in fields:
            out["timing"] = timing(runs, started, received_ms)
        return out

    return build


def timing(runs: list[RunningRequest], started: float, received_ms: int) -> dict:
    """Dynamo's TimingInfo of a request (its choices: the first token of any, the last end
    so far); a field not known yet is left out, as Dynamo leaves it."""

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) * 1000, 3)

    run = runs[0]
    first = min((r.first_token_at for r in runs if r.first_token_at is not None), default=None)
    ended = max((r.ended_at for r in runs if r.ended_at is not None), default=None)
    out: dict = {"request_received_ms": received_ms}
    for name, value in (
        ("prefill_wait_time_ms", ms(started, run.sent_at)),
        ("prefill_time_ms", ms(run.sent_at, first)),
        ("ttft_ms", ms(started, first)),
        ("total_time_ms", ms(started, ended)),
        ("kv_hit_rate", run.kv_hit_rate),
    ):
        if value is not None:
            out[name] = value
    return out


def annotation_events(ext: NvExt | None, token_ids: list[int],
                      decode: Callable[[list[int], bool], str]) -> bytes:  # fmt: skip
    """The SSE events of the annotations asked for, in the order asked (b"": none)."""
    out = b""
    for name in dict.fromkeys(ext.annotations or ()) if ext is not None else ():
        if name not in ANNOTATIONS:  # others: ignored, as Dynamo's frontend ignores them
            continue
        value = decode(token_ids, False) if name == "formatted_prompt" \
            else json.dumps(token_ids, separators=(",", ":"))  # fmt: skip
        out += f"event: {name}\r\n: {json.dumps(value)}\r\n\r\n".encode()
    return out


async def session_lookup(redis: aioredis.Redis, sc: SessionControl | None) -> dict[str, str]:
    """What a session's last turn left (``decode``, ``prefill``: its workers; ``timeout``);
    empty for a new session, or when Redis does not answer (routed as usual)."""
    if sc is None:
        return {}
    try:
        got = await redis.hgetall(session_key(sc.session_id))
    except (RedisError, OSError):
        return {}
    return {as_str(k): as_str(v) for k, v in got.items()}


async def session_record(redis: aioredis.Redis, sc: SessionControl | None,
                         known: dict[str, str], run: RunningRequest) -> None:  # fmt: skip
    """Where the session's turn ran, for its next turns, for its timeout (``open`` sets it,
    later turns keep it); ``close``: it is forgotten."""
    if sc is None:
        return
    key = session_key(sc.session_id)
    timeout = sc.timeout if sc.action == "open" or "timeout" not in known \
        else int(known["timeout"])  # fmt: skip
    w = run.workers
    mapping: dict[str | bytes | bytearray | memoryview | int | float, Any] = {
        "decode": w.get("decode_worker_id", ""), "timeout": timeout}  # fmt: skip
    if w.get("prefill_worker_id") not in (None, w.get("decode_worker_id")):
        mapping["prefill"] = w["prefill_worker_id"]
    try:
        if sc.action == "close":
            await redis.delete(key)
            return
        pipe = redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=mapping)
        pipe.expire(key, timeout)
        await pipe.execute()
    except (RedisError, OSError):
        pass  # its next turn is routed as usual


def speculative(ext: NvExt | None) -> bool:
    """Whether Dynamo's ``agent_hints.speculative_prefill`` is asked for."""
    return bool(ext is not None and (ext.agent_hints or {}).get("speculative_prefill") is True)


async def warm(runner: Runner, rid: str, prompt_ids: list[int], lora: LoraRef | None,
               cache_salt: str | None) -> None:  # fmt: skip
    """Prefill ``prompt_ids`` (one token generated, dropped), routed as any request: the
    KV-aware router sends it where the conversation is cached, and its blocks stay there
    for the next turn. Best effort: a refusal (admission, no worker) or a failure is
    logged, never raised; it ends within WARM_TIMEOUT_S."""
    sampling = Sampling(max_tokens=1, temperature=0.0, cache_salt=cache_salt)
    try:
        async with asyncio.timeout(WARM_TIMEOUT_S):
            (run,) = await runner.start(rid, prompt_ids, sampling, time.perf_counter(),
                                        lora=lora)  # fmt: skip
            try:
                async for batch in runner.batches(run):
                    if batch[-1].done:
                        break
            finally:
                runner.finish(run)
    except Exception as e:  # noqa: BLE001 - a warm-up never fails anything
        log.info("[%s] speculative prefill not done: %s", rid, e)
        return
    log.debug("[%s] speculative prefill of %d tokens done", rid, len(prompt_ids))
