"""KVBM tiers in the engines: a prompt whose prefix left the engine pool (G1) and comes back
from host memory (G2) or disk (G3) gives exactly the greedy tokens a recompute gives — on
the default model and a grouped-query-attention Llama, aggregated and disaggregated (the
decode side pulling the prefill's KV through the same loading state); damaged disk blocks
are counted misses that change nothing; a restarted engine serves its first request from
its disk; a request cancelled while its KV loads gives every block back; no tier grows
past its size; and while one request loads, the others keep running."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvbm.disk import HEADER_BYTES
from kvbm.protocol import G3, Sampling
from tasks.settings import engine_config
from tests.unit.workers.test_disagg_engine import Pull
from tests.unit.workers.test_engine_parity import _write_gqa_llama
from workers.engine import Engine
from workers.engine_api import EngineRequest, ImportedPrefill, RequestOutput
from workers.mock_engine import MockEngine, MockTiming

BASE = dict(num_kv_blocks=40, block_size=16, max_model_len=256, max_num_batched_tokens=96)
rng = random.Random(22)
SHARED = [1] + [rng.randrange(5, 500) for _ in range(111)]  # 7 blocks every prompt shares
PROMPTS = [SHARED + [rng.randrange(5, 500) for _ in range(n)] for n in (40, 73, 88, 9)]
FLOOD = [[1] + [rng.randrange(5, 500) for _ in range(180)] for _ in range(5)]
OUT = [12, 7, 15, 9]


def params(n: int) -> Sampling:
    return Sampling(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine, reqs: list[EngineRequest], timeout: float = 120.0) -> dict[str, RequestOutput]:  # type: ignore[no-untyped-def]
    """Step until every request ended (sleeping while only loads are under way); each
    request's last output, with all its tokens (and logprobs, when it asked)."""
    for r in reqs:
        assert engine.add_request(r) is None
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    lps: dict[str, list] = {}
    last: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished:
        assert time.monotonic() < deadline, "the engine did not finish"
        outs = engine.step()
        if not outs and engine.stalled:
            time.sleep(0.001)
        for o in outs:
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            if o.logprobs is not None:
                lps.setdefault(o.request_id, []).extend(o.logprobs)
            last[o.request_id] = o
    for rid, o in last.items():
        o.token_ids = toks[rid]
        o.logprobs = lps.get(rid)
    return last


def settle(engine, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Let the offload copies end (the engine collects them when it steps)."""
    off = engine.scheduler.offload
    deadline = time.monotonic() + timeout
    while off is not None and (off.busy or engine.scheduler.kv.pool.num_pinned):
        assert time.monotonic() < deadline, "offload copies did not end"
        engine.step()
        time.sleep(0.002)


def steady(engine) -> None:  # type: ignore[no-untyped-def]
    """Every tier's accounting is back at rest and within its size."""
    settle(engine)
    s = engine.scheduler
    assert engine.stats().blocks_used == 0 and s.kv.pool.num_pinned == 0
    assert s.kv.num_seqs == 0 and not s.loads and not s.running and not s.waiting
    off = s.offload
    for tier in (off.host, off.disk):
        if tier is not None:
            assert tier.num_pinned == 0 and tier.num_pending == 0
            assert len(tier) <= tier.capacity and tier.num_used == len(tier)


@pytest.fixture(scope="module")
def gqa_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_gqa_llama(tmp_path_factory.mktemp("models") / "gqa", tiny_model_dir)


@pytest.fixture(params=["llava", "gqa"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    return tiny_model_dir if request.param == "llava" else request.getfixturevalue("gqa_dir")


def recompute(model_dir: Path) -> list[list[int]]:
    e = Engine.from_model_dir(model_dir, engine_config(**BASE, enable_prefix_caching=False))
    outs = run(e, [EngineRequest(str(i), p, params(n)) for i, (p, n) in
                   enumerate(zip(PROMPTS, OUT, strict=True))])  # fmt: skip
    return [outs[str(i)].token_ids for i in range(len(PROMPTS))]


def tiered(model_dir: Path, tier: str, disk_dir: Path, **over: object) -> Engine:
    cfg = engine_config(**{**BASE, **over}, host_cache_blocks=120 if tier == "g2" else 0,
                       disk_cache_blocks=120 if tier == "g3" else 0, disk_dir=str(disk_dir),
                       disk_offload_filter=False)  # fmt: skip
    return Engine.from_model_dir(model_dir, cfg)


def evict_g1(engine: Engine) -> None:
    """Other traffic pushes every prompt out of the engine pool."""
    run(engine, [EngineRequest(f"flood{i}", p, params(2)) for i, p in enumerate(FLOOD)])
    settle(engine)
    cached = set(engine.scheduler.kv.pool.cached_hashes())
    from kvbm.protocol import block_hashes

    assert not cached & set(block_hashes(SHARED, 16)), "the shared prefix is still in G1"


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("tier", ["g2", "g3"])
def test_onboarded_prefixes_give_the_recomputed_tokens(
    model_dir: Path, tier: str, tmp_path: Path
) -> None:
    want = recompute(model_dir)
    e = tiered(model_dir, tier, tmp_path)
    first = run(e, [EngineRequest(f"a{i}", p, params(n)) for i, (p, n) in
                    enumerate(zip(PROMPTS, OUT, strict=True))])  # fmt: skip
    assert [first[f"a{i}"].token_ids for i in range(4)] == want
    evict_g1(e)
    # all at once: some load while others start, and the shared prefix comes up once
    # per request that needs it
    again = run(e, [EngineRequest(f"b{i}", p, params(n)) for i, (p, n) in
                    enumerate(zip(PROMPTS, OUT, strict=True))])  # fmt: skip
    assert [again[f"b{i}"].token_ids for i in range(4)] == want
    cached = [again[f"b{i}"].num_cached_tokens for i in range(4)]
    assert cached[0] >= 144 and all(c >= 112 for c in cached), cached
    kv = e.stats().kvbm
    assert kv is not None
    direction = "h2d" if tier == "g2" else "d2d"
    assert kv.onboard_blocks[direction] >= 7
    assert kv.matched_tokens[tier] >= 112
    assert sum(kv.onboard_latency_counts) >= 1
    steady(e)
    e.close()


def test_onboarded_prefixes_give_the_recomputed_logprobs(model_dir: Path, tmp_path: Path) -> None:
    """Output logprobs of a prompt whose prefix came back from G2 equal a recompute's."""
    lp_params = Sampling(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    reqs = lambda tag: [EngineRequest(f"{tag}{i}", p, lp_params)  # noqa: E731
                        for i, p in enumerate(PROMPTS)]  # fmt: skip
    fresh = Engine.from_model_dir(model_dir, engine_config(**BASE, enable_prefix_caching=False))
    want = run(fresh, reqs("w"))
    e = tiered(model_dir, "g2", tmp_path)
    run(e, reqs("a"))
    evict_g1(e)
    again = run(e, reqs("b"))
    assert all(again[f"b{i}"].num_cached_tokens >= 112 for i in range(len(PROMPTS)))
    for i in range(len(PROMPTS)):
        got, ref = again[f"b{i}"], want[f"w{i}"]
        assert got.token_ids == ref.token_ids
        assert got.logprobs is not None and ref.logprobs is not None
        for (lp, rank, top), (wlp, wrank, wtop) in zip(got.logprobs, ref.logprobs, strict=True):
            assert abs(lp - wlp) < 1e-4 and rank == wrank
            assert [t for t, _ in top] == [t for t, _ in wtop]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(top, wtop, strict=True))
    e.close()


@pytest.mark.parametrize("how", ["corrupt", "truncated", "deleted"])
def test_damaged_disk_blocks_are_counted_misses_with_the_same_tokens(
    tiny_model_dir: Path, tmp_path: Path, how: str
) -> None:
    want = recompute(tiny_model_dir)[0]
    e = tiered(tiny_model_dir, "g3", tmp_path)
    assert run(e, [EngineRequest("a", PROMPTS[0], params(OUT[0]))])["a"].token_ids == want
    evict_g1(e)
    from kvbm.protocol import block_hashes

    hs = block_hashes(PROMPTS[0], 16)
    path = e.scheduler.offload.store.path(hs[3])
    if how == "deleted":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw = raw[: HEADER_BYTES + 10] if how == "truncated" else raw
        if how == "corrupt":
            raw[HEADER_BYTES + 100] ^= 0x40
        path.write_bytes(bytes(raw))
    out = run(e, [EngineRequest("b", PROMPTS[0], params(OUT[0]))])["b"]
    assert out.token_ids == want
    assert out.num_cached_tokens == 3 * 16  # blocks 0-2 came from disk, the rest recomputed
    kv = e.stats().kvbm
    assert kv is not None and kv.onboard_failures == 1 and kv.onboard_blocks["d2d"] == 3
    # the bad block left G3 (with what it held below it) and is written again
    settle(e)
    assert e.scheduler.offload.disk.slot(hs[3]) is not None
    steady(e)
    e.close()


def test_a_restarted_engine_serves_its_first_request_from_its_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    want = recompute(tiny_model_dir)[1]
    e = tiered(tiny_model_dir, "g3", tmp_path)
    run(e, [EngineRequest("a", PROMPTS[1], params(OUT[1]))])
    steady(e)
    e.close()
    e2 = tiered(tiny_model_dir, "g3", tmp_path)
    warm = [ev for ev in e2.take_kv_events() if ev.tier == G3 and ev.kind == "stored"]
    assert len(warm) == 1 and len(warm[0].block_hashes) == len(PROMPTS[1]) // 16
    out = run(e2, [EngineRequest("b", PROMPTS[1], params(OUT[1]))])["b"]
    assert out.token_ids == want
    assert out.num_cached_tokens == (len(PROMPTS[1]) // 16) * 16
    assert e2.stats().kvbm.matched_tokens["g3"] == out.num_cached_tokens  # type: ignore[union-attr]
    steady(e2)
    e2.close()


# ------------------------------------------------------------------------- disaggregated


def test_disaggregated_with_tiers_gives_the_recomputed_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    want = recompute(model_dir)
    # room for all four prompts pinned at once even when each onboards its own copy of the
    # shared prefix (prompts loading together do not share it): 33 blocks pinned, and the
    # one still waiting needs 10. With 40 the harness deadlocked 1 run in 3: it releases
    # the pins only once every prefill ended (a decode worker pulls them as they come).
    prefill = tiered(model_dir, "g2", tmp_path, num_kv_blocks=48)
    decode = Engine.from_model_dir(model_dir, engine_config(**BASE))
    for wave in ("a", "b"):
        if wave == "b":
            evict_g1(prefill)  # the prefill side onboards the prompts from G2 this time
        reqs = [EngineRequest(f"{wave}{i}", p, params(n), prefill_only=True)
                for i, (p, n) in enumerate(zip(PROMPTS, OUT, strict=True))]  # fmt: skip
        first = run(prefill, reqs)
        pulls = []
        for i, (p, n) in enumerate(zip(PROMPTS, OUT, strict=True)):
            o = first[f"{wave}{i}"]
            assert o.prefilled and o.kv_block_ids
            pull = Pull(prefill, decode, o.request_id, o.kv_block_ids)
            pulls.append(pull)
            imported = ImportedPrefill(o.token_ids[0], len(o.text), pull, o.num_cached_tokens)
            assert decode.add_request(EngineRequest(o.request_id, p, params(n),
                                                    imported=imported)) is None  # fmt: skip
        rest = run(decode, [])
        for pull in pulls:
            assert pull.why is None
            prefill.release_pinned(pull.rid)
        got = [first[f"{wave}{i}"].token_ids + rest[f"{wave}{i}"].token_ids for i in range(4)]
        assert got == want, wave
        cached = [rest[f"{wave}{i}"].num_cached_tokens for i in range(4)]
        if wave == "b":  # the usage the decode side reports counts the prefill's onboarding
            assert prefill.stats().kvbm.onboard_blocks["h2d"] >= 7  # type: ignore[union-attr]
            assert all(c >= 112 for c in cached), cached
    steady(prefill)
    assert decode.stats().blocks_used == 0
    prefill.close()


def test_an_import_with_no_room_fails_after_its_deadline(tiny_model_dir: Path) -> None:
    decode = Engine.from_model_dir(tiny_model_dir, engine_config(**BASE))
    hog = decode.scheduler.kv.allocate_slots("hog", 40 * 16)  # every block
    assert hog is not None
    pull = Pull(decode, decode, "x", [0])
    pull.deadline = time.monotonic() + 0.05
    imported = ImportedPrefill(5, 0, pull)
    decode.add_request(EngineRequest("x", PROMPTS[0], params(3), imported=imported))
    time.sleep(0.1)
    assert decode.step() == [] and pull.why == "no free KV blocks to receive the prefill"
    assert not decode.has_unfinished
    decode.scheduler.kv.free("hog")
    assert decode.stats().blocks_used == 0


# ------------------------------------------------------------------ mock engine: timing


def mock(tmp: Path, tokenizer_dir: Path, disk_us: float) -> MockEngine:
    timing = MockTiming(prefill_us_per_token=0, decode_step_ms=1, host_copy_us_per_block=10,
                        disk_us_per_block=disk_us)  # fmt: skip
    cfg = engine_config(**BASE, disk_cache_blocks=120, disk_dir=str(tmp),
                       disk_offload_filter=False)  # fmt: skip
    return MockEngine.from_model_dir(tokenizer_dir, cfg, timing)


def test_while_one_request_loads_the_others_keep_decoding(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    e = mock(tmp_path, tiny_model_dir, disk_us=40_000)  # 40 ms a block: 7 blocks, 280 ms
    run(e, [EngineRequest("seed", PROMPTS[0], params(2))])
    settle(e, timeout=20)
    evict_g1(e)
    assert e.add_request(EngineRequest("long", FLOOD[0][:40], params(200))) is None
    e.step()
    assert e.add_request(EngineRequest("load", PROMPTS[0], params(2))) is None
    tokens_while_loading = 0
    t0 = time.monotonic()
    while True:
        outs = e.step()
        if "load" in e.scheduler.loads:
            tokens_while_loading += sum(len(o.token_ids) for o in outs if o.request_id == "long")
        elif any(o.request_id == "load" for o in outs) or time.monotonic() - t0 > 5:
            break
    assert tokens_while_loading >= 20  # ~1 ms decode steps through a ~280 ms load
    e.abort("long")
    run(e, [])
    steady(e)


def test_a_request_cancelled_while_loading_gives_every_block_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    e = mock(tmp_path, tiny_model_dir, disk_us=30_000)
    run(e, [EngineRequest("seed", PROMPTS[2], params(2))])
    settle(e, timeout=20)
    evict_g1(e)
    assert e.add_request(EngineRequest("c", PROMPTS[2], params(5))) is None
    e.step()
    assert "c" in e.scheduler.loads and e.stats().blocks_used > 0
    assert e.abort("c") is None  # its blocks are being written: freed when the copy ends
    assert e.stats().blocks_used > 0 and e.stats().loading == 1
    outs = []
    deadline = time.monotonic() + 10
    while not outs:
        assert time.monotonic() < deadline
        outs = e.step()
        time.sleep(0.005)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("c", True, "abort")]
    steady(e)
    assert e.stats().kvbm.disk_blocks_pinned == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("abort_first", [False, True])
def test_choices_whose_first_loads_its_prefix(
    tiny_model_dir: Path, tmp_path: Path, abort_first: bool
) -> None:
    """n=3 whose prompt's prefix comes from disk: the first choice waits in the loading
    state with the others parked on it, then they fork from it as its prompt completes;
    the first choice aborted while loading, the others run on their own."""
    from workers.choices import ChoiceGroups

    e = mock(tmp_path, tiny_model_dir, disk_us=20_000)
    run(e, [EngineRequest("seed", PROMPTS[1], params(2))])
    settle(e, timeout=20)
    evict_g1(e)
    reqs = ChoiceGroups().expand(EngineRequest("g", PROMPTS[1], params(4).model_copy(
        update={"n": 3})))  # fmt: skip
    for r in reqs:
        assert e.add_request(r) is None
    e.step()
    assert "g.c0" in e.scheduler.loads and e.stats().waiting == 2  # the two parked
    if abort_first:
        assert e.abort("g.c0") is None  # ends once its copy has
    outs = run(e, [])
    want = ["g.c1", "g.c2"] if abort_first else ["g.c0", "g.c1", "g.c2"]
    assert sorted(o for o in outs if outs[o].finish_reason == "length") == want
    assert all(len(outs[c].token_ids) == 4 for c in want)
    steady(e)
