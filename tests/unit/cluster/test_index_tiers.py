"""The router's local index with tiers (cluster.index.LocalIndex): tier-named event batches
and snapshots, and per-tier prefix overlaps found by bisection equal a block-by-block walk
whenever every tier keeps the ancestors of what it holds."""

from __future__ import annotations

import json
import random
import time

import pytest

from cluster.index import LocalIndex, encode_batch
from kvbm.protocol import G1, G2, G3, block_hashes


def batch(*events: tuple) -> list[list]:
    return json.loads(encode_batch(list(events)))


def test_a_g1_batch_encodes_as_before_and_tiers_are_named_otherwise() -> None:
    assert encode_batch([("stored", [255])]) == '[["s", ["ff"]]]'
    assert encode_batch([("stored", [255], G1)]) == '[["s", ["ff"]]]'
    assert encode_batch([("removed", [1], G3)]) == '[["r", ["1"], 3]]'


def test_events_per_tier_and_cleared_for_all() -> None:
    idx = LocalIndex()
    assert idx.apply("w", 0, batch(("cleared", []), ("stored", [1, 2]), ("stored", [2, 3], G2),
                                   ("stored", [3], G3)))  # fmt: skip
    assert idx.tiers_of("w", 2) == {G1, G2} and idx.tiers_of("w", 3) == {G2, G3}
    assert idx.worker_blocks("w") == {1, 2, 3} and idx.worker_blocks("w", G2) == {2, 3}
    assert idx.apply("w", 1, batch(("removed", [2], G1), ("removed", [3], G2)))
    assert idx.tiers_of("w", 2) == {G2} and idx.tiers_of("w", 3) == {G3}
    assert idx.holders(3) == {"w"}
    assert idx.apply("w", 2, batch(("removed", [3], G3)))
    assert idx.holders(3) == set() and idx.num_blocks == 2
    assert not idx.apply("w", 4, batch(("stored", [9])))  # skipped 3: reload it
    assert idx.apply("w", 5, batch(("cleared", [])))  # a fresh start always applies
    assert idx.worker_blocks("w") == set() and idx.seq("w") == 5


def test_snapshot_load_and_drop() -> None:
    idx = LocalIndex()
    idx.load("a", 7, [1, 2], host=[2, 3], disk=[4])
    assert idx.seq("a") == 7 and idx.tiers_of("a", 2) == {G1, G2}
    assert idx.tiers_of("a", 4) == {G3}
    idx.drop("a")
    assert idx.num_blocks == 0 and idx.workers == set()


def _walk(held: dict[int, int], hashes: list[int], mask: int) -> int:
    n = 0
    for h in hashes:
        if not held.get(h, 0) & mask:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tier_overlaps_equal_a_block_by_block_walk(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(16 * 40)] for _ in range(4)]
    chains = [block_hashes(p, 16) for p in prompts]
    idx = LocalIndex()
    truth: dict[str, dict[int, int]] = {}
    for w in range(12):
        wid = f"w{w}"
        mine: dict[int, int] = {}
        events = [("cleared", [], G1)]
        for chain in rng.sample(chains, 2):
            # each tier holds a prefix of the chain (ancestors kept), of its own length
            for tier, bit in ((G1, 1), (G2, 2), (G3, 4)):
                k = rng.choice([0, 0, rng.randrange(len(chain) + 1)])
                events.append(("stored", chain[:k], tier))
                for h in chain[:k]:
                    mine[h] = mine.get(h, 0) | bit
        truth[wid] = mine
        assert idx.apply(wid, 0, batch(*events))
    ids = sorted(truth)
    for chain in chains:
        for cut in (len(chain), len(chain) // 2, 1):
            hs = chain[:cut]
            got = idx.tier_overlaps(ids, hs)
            for w in ids:
                want = tuple(_walk(truth[w], hs, m) for m in (1, 3, 7))
                assert got[w] == want, (w, cut)
            assert idx.overlaps(ids, hs) == {w: got[w][2] for w in ids}


def test_without_lower_tiers_the_tier_overlaps_are_the_overlaps() -> None:
    idx = LocalIndex()
    idx.apply("a", 0, batch(("stored", [1, 2, 3])))
    idx.apply("b", 0, batch(("stored", [1])))
    assert idx.tier_overlaps(["a", "b", "c"], [1, 2, 3, 4]) == {
        "a": (3, 3, 3), "b": (1, 1, 1), "c": (0, 0, 0),
    }  # fmt: skip
    idx.apply("b", 1, batch(("stored", [2, 3], G3)))
    assert idx.tier_overlaps(["a", "b"], [1, 2, 3, 4])["b"] == (1, 1, 3)
    idx.apply("b", 2, batch(("removed", [2, 3], G3)))
    assert idx.tier_overlaps(["a", "b"], [1, 2, 3])["b"] == (1, 1, 1)


def test_approximate_overlaps_equal_a_walk_of_what_was_remembered() -> None:
    """Approximate mode (no KV events): the blocks a router sent each worker, until they
    expire; the bisection over them equals a block-by-block walk, the expired count 0."""
    rng = random.Random(5)
    chain = block_hashes([rng.randrange(100) for _ in range(16 * 50)], 16)
    idx = LocalIndex()
    cuts = {f"w{i}": rng.randrange(len(chain) + 1) for i in range(40)}
    for w, k in cuts.items():
        now = time.monotonic()
        idx.remember(w, chain[:k], expiry=now + (100 if w != "w0" else -1))  # w0's expired
    ids = sorted(cuts)
    got = idx.overlaps(ids, chain, approx=True)
    assert list(got) == ids
    assert got == {w: 0 if w == "w0" else k for w, k in cuts.items()}
