"""The Conversations API's store: a conversation and its items in Redis, shared by every
API replica.

A conversation is three keys under one hash tag (one slot in a Redis Cluster):
``meta`` (HASH: ``created_at``, ``metadata`` as JSON), ``ids`` (LIST: its item ids in
order) and ``items`` (HASH: item id -> the item as JSON). Adding items is one script that
refuses a conversation that does not exist and skips an item whose id it holds already
(so a response's turn, whose item ids come from its response id, is never added twice).
Every read and write renews the three keys' TTL: a conversation in use does not expire.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from cluster.keys import KEY_PREFIX
from cluster.resp import as_str

HMGET_CHUNK = 1000  # ids per HMGET inside a script (Lua's unpack has a stack limit)


def conversation_keys(conversation_id: str) -> list[str]:
    """meta, ids, items (see the module's text)."""
    base = f"{KEY_PREFIX}conversation:{{{conversation_id}}}"
    return [f"{base}:meta", f"{base}:ids", f"{base}:items"]


_RENEW = "for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ARGV[1]) end"

# KEYS: meta, ids, items. ARGV: ttl, then (item id, item JSON) pairs. Returns the ids of
# the items added (those not held already), or -1 if there is no such conversation.
ADD_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local added = {{}}
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[3], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    added[#added + 1] = ARGV[i]
  end
end
{_RENEW}
return added
"""

# KEYS: meta, ids, items. ARGV: ttl, '1' to read the items too. Returns false if there is
# no such conversation, else {created_at, metadata JSON, item JSON...} in its order.
READ_LUA = f"""
local meta = redis.call('HMGET', KEYS[1], 'created_at', 'metadata')
if not meta[1] then return false end
local out = {{meta[1], meta[2]}}
local ids = ARGV[2] == '1' and redis.call('LRANGE', KEYS[2], 0, -1) or {{}}
for s = 1, #ids, {HMGET_CHUNK} do
  local part = redis.call('HMGET', KEYS[3], unpack(ids, s, math.min(s + {HMGET_CHUNK - 1}, #ids)))
  for _, v in ipairs(part) do if v then out[#out + 1] = v end end
end
{_RENEW}
return out
"""

# KEYS: meta, ids, items. ARGV: ttl, item id. Removes the item; returns 1, 0 if the
# conversation does not hold it, -1 if there is no such conversation.
REMOVE_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HDEL', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('LREM', KEYS[2], 1, ARGV[2])
{_RENEW}
return 1
"""

# KEYS: meta, ids, items. ARGV: ttl, metadata JSON. 1, or 0 if there is no such conversation.
SET_META_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[2])
{_RENEW}
return 1
"""


class Conversation:
    """A conversation as read back: its creation time, metadata and items in order."""

    def __init__(self, conversation_id: str, created_at: int, metadata: dict[str, str],
                 items: list[dict]) -> None:  # fmt: skip
        self.id = conversation_id
        self.created_at = created_at
        self.metadata = metadata
        self.items = items

    def body(self) -> dict[str, Any]:
        """The Conversation object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}  # fmt: skip


class ConversationStore:
    """Conversations on an asyncio client; ``ttl_s``: how long one is kept unused."""

    def __init__(self, client: aioredis.Redis, ttl_s: float) -> None:
        self._r = client
        self.ttl_s = int(ttl_s)
        self._add = client.register_script(ADD_LUA)
        self._read = client.register_script(READ_LUA)
        self._remove = client.register_script(REMOVE_LUA)
        self._set_meta = client.register_script(SET_META_LUA)

    async def create(self, conversation_id: str, created_at: int, metadata: dict[str, str],
                     items: list[dict]) -> None:  # fmt: skip
        """A new conversation, holding ``items`` (each with its ``id``)."""
        meta, ids, table = conversation_keys(conversation_id)
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(meta, mapping={"created_at": created_at, "metadata": json.dumps(metadata)})
        if items:
            pipe.hset(table, mapping={it["id"]: json.dumps(it) for it in items})
            pipe.rpush(ids, *[it["id"] for it in items])
        for key in (meta, ids, table):
            pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def get(self, conversation_id: str, items: bool = True) -> Conversation | None:
        """The conversation with its items (``items``; else without them, for its body
        alone); None if there is none (never was, deleted, expired)."""
        reply = await self._read(keys=conversation_keys(conversation_id),
                                 args=[self.ttl_s, int(items)])  # fmt: skip
        if not reply:
            return None
        created, metadata, *raw = reply
        return Conversation(conversation_id, int(as_str(created)), json.loads(metadata),
                            [json.loads(x) for x in raw])  # fmt: skip

    async def add(self, conversation_id: str, items: list[dict]) -> list[str] | None:
        """Append ``items`` (each with its ``id``); the ids added (an id held already is
        skipped); None if there is no such conversation."""
        args: list[Any] = [self.ttl_s]
        for it in items:
            args += [it["id"], json.dumps(it)]
        reply = await self._add(keys=conversation_keys(conversation_id), args=args)
        if reply == -1:
            return None
        return [as_str(x) for x in reply]

    async def remove(self, conversation_id: str, item_id: str) -> bool | None:
        """Remove one item: whether it was there; None if there is no such conversation."""
        reply = int(await self._remove(keys=conversation_keys(conversation_id),
                                       args=[self.ttl_s, item_id]))  # fmt: skip
        return None if reply == -1 else bool(reply)

    async def set_metadata(self, conversation_id: str, metadata: dict[str, str]) -> bool:
        """Replace the metadata; whether the conversation exists."""
        reply = await self._set_meta(keys=conversation_keys(conversation_id),
                                     args=[self.ttl_s, json.dumps(metadata)])  # fmt: skip
        return bool(int(reply))

    async def delete(self, conversation_id: str) -> bool:
        """Forget a conversation and its items; whether there was one."""
        return bool(await self._r.delete(*conversation_keys(conversation_id)))
