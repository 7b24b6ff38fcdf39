"""Stored responses (the Responses API's ``store``): a response's record in Redis, shared
by every API replica, and the conversation a ``previous_response_id`` continues.

A response's record is one HASH (:func:`response_key`). A stored response adds to it
``turn``, the items of its turn as JSON (``{"input": [...], "output": [...]}``: the
request's input items and the output items it produced), and ``previous``, the response
it continued. A conversation is a chain of records, each naming the one before it, so a
turn is stored once however long the conversation grows. :data:`CHAIN_LUA` reads a chain
back in one round trip, and renews each record's TTL on the way (a conversation in use
does not expire under its own feet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from cluster.keys import KEY_PREFIX
from cluster.resp import as_str

# the longest conversation a previous_response_id may continue (turns)
MAX_TURNS = 1000


def response_key(response_id: str) -> str:
    """HASH: a response's record. A background or resumable one: its request (``body``),
    the stream whose frame log holds it (``log``), ``created``, ``cancelled``,
    ``background``; once it ended its ``final`` Response. A stored one also ``turn`` and
    ``previous`` (see the module's text)."""
    return f"{KEY_PREFIX}response:{response_id}"


# KEYS: none (the chain's keys are found as it is walked). ARGV: the key prefix, the last
# response id, the TTL (s) each record is renewed to, the most turns to read.
# Returns {status, ...}: {1, turn_n, ..., turn_1} (newest first), or {0, missing id}.
CHAIN_LUA = """
local prefix, id, ttl, most = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {1}
for _ = 1, most do
  local key = prefix .. id
  local f = redis.call('HMGET', key, 'turn', 'previous')
  if not f[1] then return {0, id} end
  out[#out + 1] = f[1]
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
  if not f[2] or f[2] == '' then return out end
  id = f[2]
end
return {0, id}
"""


@dataclass
class Turn:
    """One stored turn: the request's input items and the response's output items."""

    input: list[dict]
    output: list[dict]

    def items(self) -> list[dict]:
        return [*self.input, *self.output]

    def encode(self) -> str:
        return json.dumps({"input": self.input, "output": self.output})

    @classmethod
    def decode(cls, raw: bytes | str) -> Turn:
        t = json.loads(raw)
        return cls(t["input"], t["output"])


class ChainBroken(Exception):
    """A response of the chain is not stored (never was, expired or was deleted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """Stored responses on an asyncio client."""

    def __init__(self, client: aioredis.Redis, ttl_s: float) -> None:
        self._r = client
        self.ttl_s = int(ttl_s)
        self._chain = client.register_script(CHAIN_LUA)

    async def conversation(self, response_id: str) -> list[Turn]:
        """The turns up to and including ``response_id``'s, oldest first; raises
        :class:`ChainBroken` naming the first record missing."""
        reply = await self._chain(args=[response_key(""), response_id, self.ttl_s, MAX_TURNS])
        if int(reply[0]) != 1:
            raise ChainBroken(as_str(reply[1]))
        return [Turn.decode(raw) for raw in reversed(reply[1:])]

    async def save(self, response_id: str, turn: Turn, previous: str | None,
                   final: dict[str, Any], extra: dict[str, str] | None = None) -> None:  # fmt: skip
        """Store a response that ended: its turn, the one it continued and its final
        Response (what ``GET /v1/responses/{id}`` answers), with any ``extra`` fields."""
        key = response_key(response_id)
        fields: dict[Any, Any] = {"turn": turn.encode(),
                  "previous": previous or "", "final": json.dumps(final),
                  **(extra or {})}  # fmt: skip
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def turn(self, response_id: str) -> Turn | None:
        """A stored response's own turn; ``None`` if it is not stored."""
        raw = await self._r.hget(response_key(response_id), "turn")
        return None if raw is None else Turn.decode(raw)

    async def delete(self, response_id: str) -> bool:
        """Forget a response (its record, stored or not); whether there was one."""
        return bool(await self._r.delete(response_key(response_id)))
