"""``n > 1`` in the engine: a request's choices (workers.choices expands it) fork from one
prefill in the engine core (workers.scheduler), on the reference engine (real KV copied)
and the mock engine (the same scheduler); the engine process's bookkeeping of choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbm.block_pool import KVCacheManager
from kvbm.protocol import Sampling, choice_sampling, choice_seed, choice_stream_id
from tasks.settings import engine_config
from workers.choices import ChoiceGroups
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.engine_core import EngineCore
from workers.engine_ipc import Completion
from workers.mock_engine import MockEngine, MockTiming

# greedy on the tiny model, this prompt's continuation varies token to token (a choice
# decoding on KV that was not copied right goes elsewhere at once)
PROMPT = [1, 78, 183, 256, 279, 154, 50, 268, 428, 158, 111, 366]


@pytest.fixture
def make_engine(model_and_tok):  # type: ignore[no-untyped-def]
    def make(**kw: object) -> Engine:
        kw.setdefault("num_kv_blocks", 64)
        kw.setdefault("max_model_len", 256)
        return Engine(*model_and_tok, engine_config(**kw))  # type: ignore[arg-type]

    return make


def _run(engine: EngineCore, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for r in reqs:
        assert engine.add_request(r) is None
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert engine.stats().blocks_used == 0
    return outs


def _toks(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _choices(rid: str, prompt: list[int], params: Sampling) -> list[EngineRequest]:
    return ChoiceGroups().expand(EngineRequest(rid, prompt, params))


def _prompt(n: int) -> list[int]:
    return (PROMPT * (n // len(PROMPT) + 1))[:n]


# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("length", "chunk"), [(12, 2048), (32, 2048), (41, 2048), (41, 16)])
def test_greedy_choices_fork_from_one_prefill(make_engine, length: int, chunk: int) -> None:  # type: ignore[no-untyped-def]
    """Greedy n=3: every choice is the n=1 output token for token, whether the prompt
    ends inside a block (its copy is the choice's own) or on a block's end, and whether
    it is prefilled in one step or in chunks; the prompt is computed (and seen) once."""
    prompt = _prompt(length)
    alone = EngineRequest("a", prompt, Sampling(max_tokens=20, temperature=0))
    want = _toks(_run(make_engine(), [alone])["a"])
    assert len(set(want)) > 5  # a continuation that depends on the KV
    e = make_engine(max_num_batched_tokens=chunk)
    outs = _run(e, _choices("b", prompt, Sampling(max_tokens=20, temperature=0, n=3)))
    assert sorted(outs) == [choice_stream_id("b", i) for i in range(3)]
    for i in range(3):
        assert _toks(outs[f"b.c{i}"]) == want, i
        assert outs[f"b.c{i}"][-1].num_prompt_tokens == length
    st = e.stats()
    assert st.prompt_tokens_seen == st.prompt_tokens_computed == length


def test_a_forked_choice_shares_the_full_blocks_and_copies_the_partial_one(make_engine) -> None:  # type: ignore[no-untyped-def]
    e = make_engine()
    prompt = _prompt(40)  # 2 full blocks of 16, 8 tokens in the third
    for r in _choices("b", prompt, Sampling(max_tokens=8, temperature=0, n=2)):
        assert e.add_request(r) is None
    assert e.stats().waiting == 2 and e.stats().running == 0  # the second one parked
    outs = e.step()  # the prompt, and both first tokens
    assert [o.request_id for o in outs] == ["b.c0", "b.c1"]
    assert outs[0].token_ids == outs[1].token_ids
    parent, child = (e.scheduler.block_table(f"b.c{i}") for i in range(2))
    assert parent[:2] == child[:2] and parent[2] != child[2]
    pool = e.scheduler.kv.pool
    assert [pool.ref_count(b) for b in parent[:2]] == [2, 2]
    kv = e.kv.data  # [block, layer, k|v, slot, head, dim]: the 8 prompt slots were copied
    assert kv[child[2], :, :, :8].equal(kv[parent[2], :, :, :8])
    _run(e, [])


def test_seeded_choices_each_sample_as_a_request_of_their_own(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Choice i of a seeded request is the n=1 request with choice i's seed (choice 0:
    the request's own), so a seeded request reproduces all n; the choices differ."""
    params = Sampling(max_tokens=16, temperature=0.9, seed=42, n=3)
    prompt = _prompt(41)
    got = _run(make_engine(), _choices("s", prompt, params))
    again = _run(make_engine(), _choices("s", prompt, params))
    texts = [_toks(got[f"s.c{i}"]) for i in range(3)]
    assert texts == [_toks(again[f"s.c{i}"]) for i in range(3)]
    assert len({tuple(t) for t in texts}) == 3
    for i in range(3):
        alone = _run(make_engine(), [EngineRequest("a", prompt, choice_sampling(params, i))])
        assert _toks(alone["a"]) == texts[i], i
    assert choice_seed(42, 0) == 42 and choice_seed(None, 2) is None
    assert len({choice_seed(42, i) for i in range(1, 50)} | {choice_seed(43, 1)}) == 50


def test_choices_join_the_batch_together(tiny_model_dir: Path) -> None:
    """max_num_seqs=4 and a request running: a request of 4 choices waits until all four
    fit (they join the batch together, its first choice admitted with room for them)."""
    cfg = engine_config(num_kv_blocks=256, max_num_seqs=4)
    e = MockEngine.from_model_dir(tiny_model_dir, cfg, MockTiming(speedup=1000))
    assert e.add_request(EngineRequest("x", _prompt(20), Sampling(max_tokens=6))) is None
    e.step()
    for r in _choices("g", [7, *_prompt(29)], Sampling(max_tokens=4, n=4)):  # no shared prefix
        assert e.add_request(r) is None
    running = []
    outs: dict[str, list[RequestOutput]] = {}
    while e.has_unfinished:
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
        running.append(e.stats().running)
    assert max(running) == 4
    assert all(len(_toks(outs[f"g.c{i}"])) == 4 for i in range(4))
    assert outs["x"][-1].finish_reason == "length"
    st = e.stats()
    assert st.prompt_tokens_computed == st.prompt_tokens_seen == 50 and st.blocks_used == 0


def test_choices_of_a_first_choice_gone_run_on_their_own(tiny_model_dir: Path) -> None:
    """The first choice aborted before its prompt ran: the others run as requests of
    their own; a parked choice aborted ends at once."""
    e = MockEngine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256),
                                  MockTiming(speedup=1000))  # fmt: skip
    for r in _choices("g", _prompt(30), Sampling(max_tokens=3, n=3)):
        assert e.add_request(r) is None
    aborted = e.abort("g.c2")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert e.abort("g.c0") is not None
    outs = _run(e, [])
    assert sorted(outs) == ["g.c1"] and len(_toks(outs["g.c1"])) == 3
    assert e.stats().prompt_tokens_seen == 30


def test_no_block_for_the_copy_runs_the_choice_on_the_cached_prefix(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A pool with no free block when the prompt completes: the other choices wait, then
    start on the prompt's cached full block and compute its partial tail themselves."""
    e = make_engine(num_kv_blocks=2, max_model_len=32)
    prompt = _prompt(20)  # a full block and 4 tokens: the pool's 2 blocks
    outs = _run(e, _choices("t", prompt, Sampling(max_tokens=4, temperature=0, n=3)))
    assert all(len(_toks(outs[f"t.c{i}"])) == 4 for i in range(3))
    assert e.stats().prompt_tokens_computed == 20 + 2 * 4


def test_block_manager_fork_shares_named_blocks() -> None:
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("p", 10)
    kv.cache_blocks("p", list(range(10)), 10)
    assert kv.fork_blocks(10) == 1 and kv.fork_blocks(8) == 0
    assert kv.fork("p", "c", 10) == (kv.block_table("p")[2], kv.block_table("c")[2])
    assert kv.block_table("c")[:2] == kv.block_table("p")[:2]
    assert kv.block_hashes("c") == kv.block_hashes("p")
    assert kv.fork("p", "d", 8) is None and kv.block_table("d") == kv.block_table("p")[:2]
    assert kv.pool.ref_count(kv.block_table("p")[0]) == 3
    for s in ("p", "c", "d"):
        kv.free(s)
    assert kv.pool.num_used == 0


# ----------------------------------------------------------------------------------------
def test_choice_groups_expand_abort_and_complete() -> None:
    g = ChoiceGroups()
    assert g.expand(EngineRequest("one", [1, 2], Sampling())) == [
        EngineRequest("one", [1, 2], Sampling())
    ]
    reqs = g.expand(EngineRequest("r", [1, 2], Sampling(n=3, seed=9, prompt_logprobs=2)))
    assert [r.request_id for r in reqs] == ["r.c0", "r.c1", "r.c2"]
    assert [r.fork_of for r in reqs] == [None, "r.c0", "r.c0"]
    assert [r.params.seed for r in reqs] == [choice_seed(9, i) for i in range(3)]
    assert [r.params.prompt_logprobs for r in reqs] == [2, None, None]
    assert g.targets("r") == ["r.c0", "r.c1", "r.c2"] and g.targets("x") == ["x"]
    first = g.collect([Completion("r.c1", "stop", 7, 3), Completion("x", "length", 1, 1)])
    assert [c.request_id for c in first] == ["x"]
    assert g.targets("r") == ["r.c0", "r.c2"]
    done = g.collect([Completion("r.c0", "length", 7, 5),
                      Completion("r.c2", "abort", 7, 2)])  # fmt: skip
    assert done == [Completion("r", "length", 7, 10)]
    assert len(g) == 0 and g.targets("r") == ["r"]


def test_choices_of_an_image_prompt_fork_from_its_embeddings(tiny_model_dir: Path) -> None:
    """An image prompt (embeddings at the placeholders' rows, the image's key in the
    blocks it covers): the choices fork from the one prefill that used them."""
    import torch

    from kvbm.protocol import extra_keys_for_spans, image_extra_key
    from workers.engine_api import MMInput

    config = engine_config(num_kv_blocks=64, max_model_len=256)
    e = Engine.from_model_dir(tiny_model_dir, config)
    img = e.image_token_id
    assert img is not None
    prompt = [1, 78, 183, *[img] * 20, 256, 279, 154, 50]  # the image across a block edge
    embeds = torch.randn(20, e.model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    keys = extra_keys_for_spans([(3, 23, image_extra_key("ab" * 32))], len(prompt), 16)

    def req(rid: str, n: int) -> EngineRequest:
        return EngineRequest(rid, prompt, Sampling(max_tokens=12, temperature=0, n=n),
                             mm_inputs=[MMInput(3, embeds)], block_extra_keys=keys)  # fmt: skip

    want = _toks(_run(e, [req("a", 1)])["a"])
    assert len(set(want)) > 3
    e = Engine.from_model_dir(tiny_model_dir, config)
    outs = _run(e, ChoiceGroups().expand(req("b", 3)))
    assert [_toks(outs[f"b.c{i}"]) for i in range(3)] == [want] * 3
    assert e.stats().prompt_tokens_computed == len(prompt)
