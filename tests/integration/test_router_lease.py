"""Each router's lease on the load it counted, on a real redis-server with routers in real
processes: an API process killed with requests counted has them given back by the other
routers once its lease lapses (load and request-cap slots); a live router's counts
are never taken; one that stalled past its lease and comes back gives back only what it
still holds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis

from cluster.keys import load_key, load_owner_key
from cluster.membership import Heartbeat
from tasks.router import Router, RouterConfig, RouteRequest, WorkersBusy

pytestmark = pytest.mark.integration

POOL = "generate"
BS = 16
LEASE_S, PRUNE_S, CAP = 2.0, 0.5, 4
CONFIG = dict(block_size=BS, max_requests=CAP, lease_s=LEASE_S, prune_s=PRUNE_S)

# A router in its own process, as an API process holds one: it counts ``n`` requests on
# the pool (``admitted`` more past the cap, as migrated streams are), moves the first
# ``prefilled`` of them to decode blocks, prints its id, and keeps following (renewing its
# lease) until a line on stdin asks it to release everything. argv: url, n, admitted,
# prefilled, approx (1: approximate mode, its picks carry block hashes), fast (1: the
# API's RESP connection runs the scripts).
_PICKER = """
import asyncio, os, sys, traceback
import redis.asyncio as aioredis
from api.resp import RespConnection
from kvbm.protocol import block_hashes
from tasks.router import Router, RouterConfig, RouteRequest
url, n, admitted, prefilled, approx, fast = sys.argv[1], *map(int, sys.argv[2:])
async def main():
    client = aioredis.Redis.from_url(url)
    router = Router(client, RouterConfig(block_size=16, max_requests=4, lease_s=2.0,
                                         prune_s=0.5, kv_events=not approx),
                    fast=RespConnection(url) if fast else None)
    await router.start("generate")
    routes = []
    for i in range(n + admitted):
        hashes = block_hashes(list(range(i, i + 40)), 16) if approx else []
        routes.append(await router.pick("generate", RouteRequest(hashes, 40,
                                                                 admitted=i >= n)))
    for route in routes[:prefilled]:
        await router.prefilled(route)
    print(router.id, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await router.release(*routes)
    st = router.stats()["generate"]
    print("released", st["leases_reclaimed"], st["requests_reclaimed"], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
try:
    asyncio.run(main())
except BaseException:
    traceback.print_exc()
    os._exit(1)  # at once: the index follower's task must not hold the exit
"""


@pytest.fixture
def db(fresh_db: str) -> str:
    r = redis.Redis.from_url(fresh_db)
    Heartbeat(r, POOL, "a", ttl_s=120).beat()
    return fresh_db


class Picker:
    def __init__(self, url: str, n: int, admitted: int = 0, prefilled: int = 0,
                 approx: bool = False, fast: bool = False) -> None:  # fmt: skip
        argv = [str(a) for a in (url, n, admitted, prefilled, int(approx), int(fast))]
        self.p = subprocess.Popen([sys.executable, "-c", _PICKER, *argv], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        self.id = self._line()

    def _line(self) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        assert line, f"the picker process failed (exit {self.p.poll()})"
        return line

    def release(self) -> tuple[int, int]:
        """Its routes released: the routers gone and their requests it gave back."""
        assert self.p.stdin is not None
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        word, leases, reqs = self._line().split()
        assert word == "released"
        return int(leases), int(reqs)

    def close(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def counts(url: str) -> dict[str, int]:
    """The pool's load hash, as ints (zero fields left out)."""
    r = redis.Redis.from_url(url)
    return {k.decode(): int(v) for k, v in r.hgetall(load_key(POOL)).items() if int(v)}


def owned(url: str, router_id: str) -> dict[str, int]:
    r = redis.Redis.from_url(url)
    return {k.decode(): int(v) for k, v in r.hgetall(load_owner_key(POOL, router_id)).items()}


async def _until(cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``cond()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def test_a_killed_api_process_s_counts_are_given_back_and_a_live_one_s_are_not(db: str) -> None:
    # the victim counts 3 requests in approximate mode through the RESP fast path, and a
    # migrated one past the cap; the survivor 2 migrated ones: 6 on a worker capped at 4
    victim = Picker(db, 3, admitted=1, prefilled=2, approx=True, fast=True)
    survivor = Picker(db, 0, admitted=2, prefilled=1)
    try:
        theirs = owned(db, survivor.id)
        assert owned(db, victim.id)["a:reqs"] == 4 and theirs["a:reqs"] == 2
        load = counts(db)
        assert load["a:reqs"] == 6
        assert load["a:blocks"] == 3 * (3 + 1)  # three prefilled: 40 tokens + one block each

        async def go() -> tuple[float, dict, dict, tuple[int, int]]:
            client = aioredis.Redis.from_url(db)
            router = await Router(client, RouterConfig(**CONFIG)).start(POOL)
            with pytest.raises(WorkersBusy):  # the dead process's slots still count
                await router.pick(POOL, RouteRequest([], 40))
            victim.p.send_signal(signal.SIGKILL)
            took = await _until(lambda: counts(db) == theirs, LEASE_S + PRUNE_S + 10,
                                "the killed router's counts were not given back")  # fmt: skip
            # the survivor renews its lease: its counts stay through several more leases
            await asyncio.sleep(2 * LEASE_S)
            after = counts(db)
            stats = router.stats()[POOL]
            mine = await router.pick(POOL, RouteRequest([], 40))  # a slot is free again
            assert mine is not None
            by_survivor = survivor.release()
            left = counts(db)
            await router.release(mine)
            await router.aclose()
            await client.aclose()
            return took, {"after": after, "left": left}, stats, by_survivor

        took, seen, stats, by_survivor = asyncio.run(go())
    finally:
        victim.close()
        survivor.close()
    print(f"killed router's counts given back {took:.1f} s after the kill (lease {LEASE_S} s)")
    assert took <= LEASE_S + PRUNE_S + 5
    assert seen["after"] == theirs
    # one of the two live routers gave back the killed one's four requests, once
    assert (
        stats["leases_reclaimed"] + by_survivor[0],
        stats["requests_reclaimed"] + by_survivor[1],
    ) == (1, 4)
    # the survivor's release took its own and nothing of ours
    assert seen["left"] == {"a:reqs": 1, "a:prefill": 40}
    assert counts(db) == {}


def test_a_router_stalled_past_its_lease_gives_back_only_what_it_still_holds(db: str) -> None:
    """Its counts were given back while it was stopped; once it runs again it renews its
    lease without taking the others' counts, and its release leaves theirs alone."""
    stalled = Picker(db, 2, prefilled=1)

    async def go() -> tuple[dict, dict, dict]:
        client = aioredis.Redis.from_url(db)
        router = await Router(client, RouterConfig(**CONFIG)).start(POOL)
        os.kill(stalled.p.pid, signal.SIGSTOP)
        await _until(lambda: counts(db) == {}, LEASE_S + PRUNE_S + 10,
                     "the stalled router's counts were not given back")  # fmt: skip
        mine = await router.pick(POOL, RouteRequest([], 40))
        assert mine is not None
        await router.prefilled(mine)
        ours = counts(db)
        os.kill(stalled.p.pid, signal.SIGCONT)
        await asyncio.sleep(3 * PRUNE_S)  # it prunes again: its own lease had lapsed
        back = counts(db)
        stalled.release()
        released = counts(db)
        await router.release(mine)
        await router.aclose()
        await client.aclose()
        return ours, back, released

    try:
        ours, back, released = asyncio.run(go())
    finally:
        stalled.close()
    assert ours == {"a:reqs": 1, "a:blocks": 4}
    assert back == ours  # it came back and took nothing of ours
    assert released == ours  # its release gave back nothing a second time
    assert counts(db) == {}
