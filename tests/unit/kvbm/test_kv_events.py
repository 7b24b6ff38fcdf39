"""KV events and the property the router's index relies on.

The index finds a worker's prefix overlap by bisection, which is exact only if a pool that
holds a block also holds all of that block's ancestors. These tests drive a real
``KVCacheManager`` through a random workload (shared prefixes, hits, growth, frees,
evictions, preemption-style frees mid-sequence) and check that property after every
operation, and that replaying the pool's events reproduces its cached set exactly.
"""

from __future__ import annotations

import random

import pytest

from kvbm.block_pool import KVCacheManager
from kvbm.events import _fold
from kvbm.protocol import ROOT_PARENT, block_hash

BS = 4


@pytest.mark.parametrize("seed", [1234, 7, 99, 2024])
def test_cached_blocks_always_include_their_ancestors_and_events_replay_exactly(
    seed: int,
) -> None:
    rng = random.Random(seed)
    m = KVCacheManager(num_blocks=40, block_size=BS, record_events=True)
    parent: dict[int, int] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    live: dict[str, list[int]] = {}
    replay: set[int] = set()
    n_evicted = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and len(live) < 8:  # a new sequence: shared prefix + own suffix
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(30))]
            sid = f"s{step}"
            hit = m.find_prefix(sid, toks)
            if m.allocate_slots(sid, len(toks)) is None:
                m.free(sid)
                continue
            m.cache_blocks(sid, toks, len(toks))
            live[sid] = toks
            assert hit % BS == 0
        elif op < 0.7 and live:  # a sequence grows by a few decoded tokens
            sid = rng.choice(list(live))
            toks = live[sid] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            if m.allocate_slots(sid, len(toks)) is None:
                continue
            m.cache_blocks(sid, toks, len(toks))
            live[sid] = toks
        elif live:  # finished, aborted or preempted: all its blocks go back
            sid = rng.choice(list(live))
            del live[sid]
            m.free(sid)
        # chain bookkeeping for the check: every full block of every known sequence
        for toks in live.values():
            p = ROOT_PARENT
            for b in range(len(toks) // BS):
                h = block_hash(p, toks[b * BS : (b + 1) * BS], 0)
                parent[h] = p
                p = h
        for ev in m.pool.take_events():
            if ev.kind == "stored":
                replay.update(ev.block_hashes)
            elif ev.kind == "removed":
                n_evicted += len(ev.block_hashes)
                replay.difference_update(ev.block_hashes)
        cached = set(m.pool.cached_hashes())
        assert replay == cached, f"step {step}: events do not replay to the cached set"
        for h in cached:
            p = parent.get(h, ROOT_PARENT)
            assert p == ROOT_PARENT or p in cached, f"step {step}: block cached, parent evicted"
    assert n_evicted > 100  # the workload did exercise eviction


def test_fold_merges_runs_of_one_kind_and_tier_and_keeps_order() -> None:
    from kvbm.block_pool import KVEvent
    from kvbm.protocol import G1, G2, G3

    events = [
        KVEvent("stored", [1, 2]), KVEvent("stored", [3]), KVEvent("removed", [1]),
        KVEvent("cleared", []), KVEvent("cleared", []), KVEvent("stored", [1]),
        KVEvent("stored", [1], G2), KVEvent("stored", [2], G2), KVEvent("stored", [5]),
        KVEvent("removed", [1], G3),
    ]  # fmt: skip
    assert _fold(events) == [
        ("stored", [1, 2, 3], G1), ("removed", [1], G1), ("cleared", [], G1),
        ("cleared", [], G1), ("stored", [1], G1), ("stored", [1, 2], G2),
        ("stored", [5], G1), ("removed", [1], G3),
    ]  # fmt: skip
