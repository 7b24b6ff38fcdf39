"""What every script shares: Redis's clock and the liveness rule, one copy each.

A heartbeat writes ``now + ttl`` (Redis's clock, ms) as the worker's score in its pool's
alive ZSET (and its report under :func:`cluster.keys.worker_key` with the same TTL). A
worker is live while its score is above Redis's now: :data:`LIVE_LUA` is that rule for
every reader (the router's commit and view, the API's stream checks, queue depths, the
prune). Scripts that use it start with :data:`NOW_LUA`, which defines ``now``."""

from __future__ import annotations

CLOCK_LUA = """
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

NOW_LUA = CLOCK_LUA + "local now = clock()\n"

LIVE_LUA = """
local function is_live(akey, wid, now)
  local exp = redis.call('ZSCORE', akey, wid)
  return exp ~= false and exp ~= nil and tonumber(exp) > now
end
local function live_ids(akey, now)
  local ids = redis.call('ZRANGE', akey, '(' .. now, '+inf', 'BYSCORE')
  table.sort(ids)
  return ids
end
"""


def lua_list(items: tuple[str, ...] | list[str]) -> str:
    """A Lua table literal of plain strings (no quotes or backslashes in them)."""
    assert all("'" not in s and "\\" not in s for s in items), items
    return "{" + ", ".join(f"'{s}'" for s in items) + "}"
