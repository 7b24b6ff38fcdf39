"""KVEventTranslator: vLLM's KV events renamed in Conveyor's block hashes (no vLLM needed).

The events are plain stand-ins for vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (the translator reads them by type name and attributes, as they come
off vLLM's msgpack decoder); the translator itself is the real one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvbm.protocol import block_hashes, image_extra_key
from workers.vllm_events import KVEventTranslator


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    extra_keys: list | None = None
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class FakeVllm:
    """Stores a prompt's full blocks as vLLM's prefix cache does: one BlockStored per
    request, blocks named by a hash of its own (here: the token prefix)."""

    block_size: int
    held: dict = field(default_factory=dict)

    def store(self, prompt: list[int]) -> BlockStored | None:
        n = len(prompt) // self.block_size
        names = [("v", tuple(prompt[: (i + 1) * self.block_size])) for i in range(n)]
        new = [i for i in range(n) if names[i] not in self.held]
        if not new:
            return None
        first = new[0]
        for i in new:
            self.held[names[i]] = True
        return BlockStored(
            [names[i] for i in new],
            names[first - 1] if first else None,
            prompt[first * self.block_size : n * self.block_size],
            self.block_size,
        )


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def _stored(events) -> list[int]:  # type: ignore[no-untyped-def]
    return [h for e in events if e.kind == "stored" for h in e.block_hashes]


def test_stored_blocks_get_the_routers_hashes_whatever_vllms_block_size() -> None:
    for vllm_bs in (16, 32, 48, 24):  # multiples of Conveyor's 16, and not
        t = KVEventTranslator(16, namespace=7)
        v = FakeVllm(vllm_bs)
        prompt = _prompt(200, vllm_bs)
        # served in two steps: a shorter prompt first, then the whole one (a child chain)
        got = _stored(t.translate([v.store(prompt[:70])]))
        got += _stored(t.translate([v.store(prompt)]))
        held = (200 // vllm_bs) * vllm_bs // 16  # the Conveyor blocks vLLM's full ones cover
        assert got == block_hashes(prompt, 16, 7)[:held], vllm_bs
        assert sorted(t.cached_hashes()) == sorted(got)


def test_a_removed_block_takes_its_descendants_and_shared_hashes_stay() -> None:
    t = KVEventTranslator(16, namespace=0)
    v = FakeVllm(32)
    a = _prompt(128, 1)
    b = a[:64] + _prompt(64, 2)  # shares a's first two vLLM blocks
    t.translate([v.store(a)])
    t.translate([v.store(b)])
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert set(t.cached_hashes()) == set(ha) | set(hb)
    # a's third vLLM block goes: its fourth (a child) goes with it, b is untouched
    third = ("v", tuple(a[:96]))
    out = t.translate([BlockRemoved([third])])
    assert sorted(h for e in out for h in e.block_hashes) == sorted(ha[4:8])
    assert set(t.cached_hashes()) == set(ha[:4]) | set(hb)
    # the shared root goes: everything chained from it goes
    out = t.translate([BlockRemoved([("v", tuple(a[:32]))])])
    assert t.cached_hashes() == [] and t.num_blocks == 0
    assert {h for e in out for h in e.block_hashes} == set(ha[:4]) | set(hb[4:])


def test_cleared_unknown_parents_and_other_tiers() -> None:
    t = KVEventTranslator(16, namespace=0)
    v = FakeVllm(32)
    p = _prompt(64, 3)
    ev = v.store(p)
    assert t.translate([BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, 32,
                                    medium="CPU")]) == []  # fmt: skip  # an offload tier
    assert t.translate([ev])[0].kind == "stored"
    # a batch lost: a child whose parent was never seen maps to nothing (and is counted)
    orphan = BlockStored([("x",)], ("never-seen",), _prompt(32, 4), 32)
    assert t.translate([orphan]) == [] and t.unmapped == 1
    out = t.translate([AllBlocksCleared()])
    assert [e.kind for e in out] == ["cleared"] and t.cached_hashes() == []


def test_image_blocks_carry_the_image_key() -> None:
    prompt = _prompt(96, 5)
    # an image of 40 placeholder tokens at offset 20: Conveyor blocks 1, 2 and 3 (of 16)
    ident = "img-abc"
    t = KVEventTranslator(16, namespace=0, image_tokens={ident: 40}.get)
    ev = BlockStored([("v", 0), ("v", 1), ("v", 2)], None, prompt, 32,
                     extra_keys=[[(ident, 20)], [(ident, -12)], None])  # fmt: skip
    got = _stored(t.translate([ev]))
    key = (image_extra_key(ident),)
    extra = [(), key, key, key, (), ()]
    assert got == block_hashes(prompt, 16, 0, extra)
