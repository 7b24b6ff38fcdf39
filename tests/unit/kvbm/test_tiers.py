"""A lower tier's bookkeeping (kvbm.tiers.TierIndex) and the disk admission filter: exact
eviction order, two-phase stores, pins, the ancestors rule, capacity, warm loading."""

from __future__ import annotations

import random

import pytest

from kvbm.protocol import G2, ROOT_PARENT
from kvbm.tiers import DISK_MIN_FREQUENCY, FrequencyFilter, TierIndex

R = ROOT_PARENT


def store(t: TierIndex, *chain: tuple[int, int]) -> None:
    for h, parent in chain:
        assert t.prepare_store(h, parent) is not None, (h, parent)
        assert t.complete_store(h)


def events(t: TierIndex) -> list[tuple[str, list[int]]]:
    return [(e.kind, e.block_hashes) for e in t.take_events()]


def test_store_is_two_phase_and_announced_once_complete() -> None:
    t = TierIndex(G2, 4)
    slot = t.prepare_store(1, R)
    assert slot == 0 and 1 not in t and t.has_or_pending(1)
    assert t.num_used == 1 and t.num_pinned == 1 and events(t) == []
    assert t.prepare_store(1, R) is None  # on its way already
    assert t.complete_store(1) and 1 in t and t.slot(1) == 0
    assert t.num_pinned == 0 and events(t) == [("stored", [1])]
    assert t.prepare_store(1, R) is None  # held already


def test_a_block_goes_in_only_after_its_parent() -> None:
    t = TierIndex(G2, 4)
    assert t.prepare_store(2, 1) is None  # parent 1 neither held nor on its way
    assert t.prepare_store(1, R) is not None
    assert t.prepare_store(2, 1) is not None  # parent on its way: the same batch
    assert t.complete_store(1) and t.complete_store(2)
    assert set(t.hashes()) == {1, 2}


def test_a_failed_copy_stores_nothing_and_its_children_fail_too() -> None:
    t = TierIndex(G2, 4)
    t.prepare_store(1, R)
    t.prepare_store(2, 1)
    assert not t.complete_store(1, ok=False)
    assert not t.complete_store(2)  # its parent never arrived
    assert len(t) == 0 and t.num_used == 0 and events(t) == []


def test_eviction_is_lru_among_leaves_tail_before_prefix() -> None:
    t = TierIndex(G2, 5)
    store(t, (1, R), (2, 1), (3, 2))  # a chain a -> b -> c
    store(t, (10, R), (11, 10))  # another
    t.touch([3, 2, 1])  # the first chain used again: the second is now older
    events(t)
    t.prepare_store(20, R)  # full: the least recently used leaf goes (11, not its parent)
    assert t.take_dropped() == [11]
    t.complete_store(20)
    t.prepare_store(21, 20)  # next: 10 became a leaf, and it is the oldest
    assert t.take_dropped() == [10]
    t.complete_store(21)
    t.prepare_store(22, 21)
    assert t.take_dropped() == [3]  # then the first chain, from its tail
    t.complete_store(22)
    assert events(t) == [("removed", [11]), ("stored", [20]), ("removed", [10]),
                         ("stored", [21]), ("removed", [3]), ("stored", [22])]  # fmt: skip


def test_pinned_blocks_and_parents_of_stores_under_way_stay() -> None:
    t = TierIndex(G2, 3)
    store(t, (1, R), (2, 1))
    assert t.pin([2]) == [1]
    assert t.prepare_store(5, 1) is not None  # a child of 1 on its way: 1 must stay
    assert t.prepare_store(6, R) is None  # 2 pinned, 1 a parent, 5 on its way: no room
    t.unpin([2])
    assert t.prepare_store(6, R) is not None  # 2 is an evictable leaf now; 1 stays
    assert t.take_dropped() == [2]
    assert t.complete_store(5) and t.complete_store(6)
    assert set(t.hashes()) == {1, 5, 6} and t.num_used == t.capacity


def test_removed_blocks_take_their_descendants_and_wait_for_pins() -> None:
    t = TierIndex(G2, 8)
    store(t, (1, R), (2, 1), (3, 2), (4, 2), (9, R))
    t.pin([3])
    events(t)
    t.remove(2)
    # 4 goes now; 3 (pinned) and 2 (its parent) when 3's copy ends
    assert set(t.hashes()) == {1, 2, 3, 9} and t.slot(2) is None and t.slot(3) is None
    assert t.prepare_store(5, 2) is None  # a doomed block takes no children
    t.unpin([3])
    assert set(t.hashes()) == {1, 9}
    assert sorted(h for _, hs in events(t) for h in hs) == [2, 3, 4]


def test_load_keeps_rooted_blocks_within_capacity_lru_leaves_dropped_first() -> None:
    t = TierIndex(G2, 4)
    # least recently used first; 7's parent (6) is missing: unreachable, left out
    found = [(3, 2), (1, R), (2, 1), (7, 6), (10, R), (11, 10)]
    kept = t.load(found)
    assert 7 not in kept and 3 not in kept  # 3: the oldest leaf, over the capacity
    assert sorted(kept) == [1, 2, 10, 11] and len(t) == 4 and events(t) == []
    t.prepare_store(20, R)  # oldest leaf now: 2 (its child 3 was dropped)
    assert t.take_dropped() == [2]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_keeps_ancestors_capacity_and_replayable_events(seed: int) -> None:
    rng = random.Random(seed)
    t = TierIndex(G2, 24)
    parent: dict[int, int] = {}
    chains = [[rng.randrange(1 << 40) for _ in range(rng.randrange(2, 12))] for _ in range(10)]
    for c in chains:
        for i, h in enumerate(c):
            parent[h] = c[i - 1] if i else R
    pending: list[int] = []
    pinned: list[int] = []
    replay: set[int] = set()
    for step in range(4000):
        op = rng.random()
        if op < 0.4:  # store a chain's prefix, parents first
            c = rng.choice(chains)
            for h in c[: rng.randrange(1, len(c) + 1)]:
                if t.prepare_store(h, parent[h]) is not None:
                    pending.append(h)
        elif op < 0.7 and pending:
            h = pending.pop(rng.randrange(len(pending)))
            t.complete_store(h, ok=rng.random() > 0.05)
        elif op < 0.8:
            held = t.hashes()
            if held:
                h = rng.choice(held)
                t.pin([h])
                pinned.append(h)
        elif op < 0.9 and pinned:
            t.unpin([pinned.pop(rng.randrange(len(pinned)))])
        elif op < 0.97:
            c = rng.choice(chains)
            t.touch(c[::-1])
        else:
            held = t.hashes()
            if held:
                t.remove(rng.choice(held))
                pinned = [h for h in pinned if h in t]
        for e in t.take_events():
            (replay.update if e.kind == "stored" else replay.difference_update)(e.block_hashes)
        held = set(t.hashes())
        assert replay == held, f"step {step}: events do not replay to the held set"
        assert t.num_used <= t.capacity
        for h in held:
            assert parent[h] == R or parent[h] in held, f"step {step}: {h} without its parent"


# --------------------------------------------------------------------- frequency filter


def test_frequency_filter_admits_a_block_stored_then_hit_twice() -> None:
    f = FrequencyFilter(decay_s=10.0)
    assert DISK_MIN_FREQUENCY == 4
    assert [f.offer(7, now=0.0), f.offer(7, now=1.0), f.offer(7, now=2.0)] == [False, False, True]
    assert f.count(7) == 4
    assert f.offer(7, now=3.0) and f.count(7) == 8


def test_frequency_filter_decays_by_one_per_period() -> None:
    f = FrequencyFilter(decay_s=10.0)
    f.offer(1, now=0.0)
    f.offer(1, now=1.0)  # 2
    assert not f.offer(1, now=15.0)  # one period later: 2 - 1 = 1, doubled: 2
    assert f.count(1) == 2
    assert not f.offer(1, now=100.0)  # long gone: starts over at 1
    assert f.count(1) == 1


def test_frequency_filter_forgets_the_least_recently_offered_past_its_size() -> None:
    f = FrequencyFilter(decay_s=10.0, max_entries=2)
    for h in (1, 2, 1, 3):
        f.offer(h, now=0.0)
    assert (f.count(1), f.count(2), f.count(3)) == (2, 0, 1)
