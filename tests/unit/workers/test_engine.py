"""Engine behaviour on the tiny model: finish reasons, abort, limits, seeded sampling,
and the EngineLoop thread wrapper."""

from __future__ import annotations

import threading

import pytest

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.engine_loop import EngineLoop
from workers.model_init import EOS

# Greedy continuation of this prompt on the tiny model emits EOS as its 16th token.
EOS_PROMPT = [1, 78, 183, 256, 279, 154, 50, 268, 428, 158, 111, 366]
EOS_AT = 15


@pytest.fixture
def make_engine(model_and_tok):
    def make(**kw) -> Engine:
        kw.setdefault("num_kv_blocks", 64)
        kw.setdefault("max_model_len", 256)
        return Engine(*model_and_tok, engine_config(**kw))

    return make


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [1] + [5 + (seed * 131 + i * 37) % 507 for i in range(n - 1)]


def _run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished
    assert engine.stats().blocks_used == 0
    return outs


def _toks(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def _add(engine: Engine, rid: str, prompt: list[int], params: Sampling) -> Engine:
    assert engine.add_request(EngineRequest(rid, prompt, params)) is None
    return engine


def _one(engine: Engine, prompt: list[int], params: Sampling) -> list[RequestOutput]:
    outs = _run(_add(engine, "r", prompt, params))["r"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return outs


def _greedy_ref(make_engine, prompt: list[int] = EOS_PROMPT, n: int = 24) -> list[int]:
    p = Sampling(temperature=0, max_tokens=n, ignore_eos=True)
    return _toks(_one(make_engine(), prompt, p))


# ------------------------------------------------------------------------ finish reasons


def test_max_tokens_gives_length(make_engine, model_and_tok) -> None:
    tok = model_and_tok[1]
    outs = _one(make_engine(), _prompt(20), Sampling(temperature=0, max_tokens=7))
    last = outs[-1]
    assert len(_toks(outs)) == 7
    assert (last.finish_reason, last.stop_reason) == ("length", None)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (20, 7)
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6, 7]
    assert _text(outs) == tok.decode(_toks(outs))


def test_eos_stops_generation(make_engine) -> None:
    ref = _greedy_ref(make_engine)
    assert ref[EOS_AT] == EOS and EOS not in ref[:EOS_AT]
    outs = _one(make_engine(), EOS_PROMPT, Sampling(temperature=0, max_tokens=24))
    assert _toks(outs) == ref[: EOS_AT + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)
    assert "</s>" not in _text(outs)


def test_ignore_eos_runs_past_eos(make_engine) -> None:
    p = Sampling(temperature=0, max_tokens=24, ignore_eos=True)
    outs = _one(make_engine(), EOS_PROMPT, p)
    toks = _toks(outs)
    assert len(toks) == 24 and toks[EOS_AT] == EOS
    assert outs[-1].finish_reason == "length"


def test_min_tokens_bans_eos_until_reached(make_engine) -> None:
    ref = _greedy_ref(make_engine)
    p = Sampling(temperature=0, max_tokens=24, min_tokens=EOS_AT + 3)
    toks = _toks(_one(make_engine(), EOS_PROMPT, p))
    assert toks[:EOS_AT] == ref[:EOS_AT]
    assert EOS not in toks[: EOS_AT + 3]
    assert toks[EOS_AT] != EOS


def test_stop_token_ids(make_engine) -> None:
    ref = _greedy_ref(make_engine)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] != EOS)
    stop_id = ref[k]
    p = Sampling(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    outs = _one(make_engine(), EOS_PROMPT, p)
    assert _toks(outs) == ref[: k + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop_id)


def test_stop_token_ids_banned_before_min_tokens(make_engine) -> None:
    ref = _greedy_ref(make_engine)
    stop_id = ref[0]
    p = Sampling(
        temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True
    )
    toks = _toks(_one(make_engine(), EOS_PROMPT, p))
    assert stop_id not in toks[:3]
    assert toks[0] != ref[0]


def test_stop_string(make_engine) -> None:
    prompt = _prompt(9, seed=1)
    ref_p = Sampling(temperature=0, max_tokens=20, ignore_eos=True)
    ref_outs = _one(make_engine(), prompt, ref_p)
    cum = [_text(ref_outs[: j + 1]) for j in range(len(ref_outs))]  # streamed text so far
    full = cum[-1]
    k = next(
        i
        for i in range(4, len(full) - 3)
        if full.find(full[i : i + 3]) == i and "\ufffd" not in full[i : i + 3]
    )
    stop = full[k : k + 3]
    p = Sampling(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)
    outs = _one(make_engine(), prompt, p)
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)
    assert _text(outs) == full[:k]
    toks = _toks(outs)
    # stopped on exactly the token that completed the stop string
    assert len(toks) == next(j + 1 for j, t in enumerate(cum) if stop in t)
    assert toks == _toks(ref_outs)[: len(toks)]


# ---------------------------------------------------------------------------- limits


def test_prompt_at_or_over_max_model_len_is_an_error(make_engine) -> None:
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    for n in (64, 65, 200):
        out = engine.add_request(EngineRequest(f"r{n}", _prompt(n), Sampling()))
        assert out is not None and out.finished
        assert out.finish_reason == "error" and out.error and "64" in out.error
        assert out.num_prompt_tokens == n and out.token_ids == []
    empty = engine.add_request(EngineRequest("e", [], Sampling()))
    assert empty is not None and empty.finish_reason == "error"
    assert not engine.has_unfinished
    assert engine.step() == []


def test_context_window_caps_generation(make_engine) -> None:
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    outs = _one(engine, _prompt(60), Sampling(temperature=0, max_tokens=20))
    assert len(_toks(outs)) == 4
    assert outs[-1].finish_reason == "length"


def test_kv_pool_must_hold_one_sequence(model_and_tok) -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Engine(*model_and_tok, engine_config(num_kv_blocks=3, block_size=16, max_model_len=64))


# ----------------------------------------------------------------------------- abort


def test_abort_frees_blocks_immediately(make_engine) -> None:
    engine = make_engine()
    p = Sampling(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request(EngineRequest("a", _prompt(70, 1), p))
    engine.add_request(EngineRequest("b", _prompt(20, 2), p))
    early = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in early] == ["a", "b"] * 3
    held_a = len(engine.scheduler.block_table("a"))
    held_b = len(engine.scheduler.block_table("b"))
    assert held_a == 5 and held_b == 2  # 72 and 22 tokens in 16-token blocks
    assert engine.stats().blocks_used == held_a + held_b

    out = engine.abort("a")
    assert out is not None and out.finished
    assert (out.request_id, out.finish_reason, out.token_ids) == ("a", "abort", [])
    assert out.num_output_tokens == 3
    assert engine.stats().blocks_used == held_b
    assert engine.abort("a") is None
    assert engine.abort("nope") is None

    outs = _run(engine)
    assert set(outs) == {"b"}
    assert len(_toks(outs["b"])) == 47  # 3 came from the early steps
    assert outs["b"][-1].num_output_tokens == 50 and outs["b"][-1].finish_reason == "length"


def test_abort_waiting_request(make_engine) -> None:
    engine = make_engine(max_num_seqs=1)
    p = Sampling(temperature=0, max_tokens=5)
    engine.add_request(EngineRequest("a", _prompt(10), p))
    engine.add_request(EngineRequest("b", _prompt(10), p))
    engine.step()
    assert [s.id for s in engine.scheduler.running] == ["a"]
    assert [s.id for s in engine.scheduler.waiting] == ["b"]
    used = engine.stats().blocks_used
    out = engine.abort("b")
    assert out is not None and out.finish_reason == "abort" and out.num_output_tokens == 0
    assert engine.stats().blocks_used == used
    assert set(_run(engine)) == {"a"}


def test_a_request_added_twice_runs_once(make_engine) -> None:
    """A second copy of a running (or waiting) request id is dropped: it neither takes
    the first one's blocks nor fails the step for every other request."""
    ref = _greedy_ref(make_engine, _prompt(20), 12)
    engine = make_engine(max_num_seqs=1)
    p = Sampling(temperature=0, max_tokens=12, ignore_eos=True)
    _add(engine, "a", _prompt(20), p)
    _add(engine, "b", _prompt(30, 1), p)
    first = engine.step()  # a runs (its first token), b waits
    _add(engine, "a", _prompt(20), p)
    _add(engine, "b", _prompt(30, 1), p)
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 1
    outs = _run(engine)  # no step fails; a's blocks are all given back
    assert [o.finish_reason for o in outs["a"] if o.finished] == ["length"]
    assert _toks(first) + _toks(outs["a"]) == ref and len(_toks(outs["b"])) == 12


# -------------------------------------------------------------------------- sampling


def test_seeded_sampling_reproducible(make_engine) -> None:
    def draw(seed: int) -> list[int]:
        p = Sampling(temperature=1.0, max_tokens=20, seed=seed, ignore_eos=True)
        return _toks(_one(make_engine(), _prompt(12), p))

    a, b, c = draw(5), draw(5), draw(6)
    assert len(a) == 20
    assert a == b
    assert a != c


def test_seeded_result_independent_of_batch(make_engine) -> None:
    p = Sampling(temperature=1.0, top_p=0.9, max_tokens=20, seed=11, ignore_eos=True)
    alone = _toks(_one(make_engine(), _prompt(30), p))

    engine = make_engine(max_num_batched_tokens=48)
    for j, n in enumerate((5, 60, 17)):
        q = Sampling(temperature=0.8, max_tokens=8 + j, seed=j)
        engine.add_request(EngineRequest(f"o{j}", _prompt(n, j + 7), q))
    engine.step()
    engine.add_request(EngineRequest("r", _prompt(30), p))
    engine.add_request(EngineRequest("late", _prompt(40, 9), Sampling(temperature=1.0)))
    outs = _run(engine)
    assert _toks(outs["r"]) == alone


def test_top_k_one_equals_greedy(make_engine) -> None:
    ref = _greedy_ref(make_engine, _prompt(25), n=20)
    p = Sampling(temperature=1.0, top_k=1, max_tokens=20, ignore_eos=True)
    assert _toks(_one(make_engine(), _prompt(25), p)) == ref


# ------------------------------------------------------------------------- EngineLoop


def test_engine_loop_threads(make_engine) -> None:
    prompts = {f"t{i}": _prompt(3 + 9 * i, i) for i in range(8)}
    want = {rid: _greedy_ref(make_engine, p, n=6 + i) for i, (rid, p) in enumerate(prompts.items())}

    got: dict[str, list[RequestOutput]] = {}
    lock = threading.Lock()
    done = threading.Event()

    def sink(outs: list[RequestOutput]) -> None:
        with lock:
            for o in outs:
                got.setdefault(o.request_id, []).append(o)
            finished = {r for r, os_ in got.items() if os_[-1].finished}
            if finished >= set(prompts) | {"long", "bad"}:
                done.set()

    engine = make_engine()
    loop = EngineLoop(engine, sink).start()
    try:

        def submit(ids: list[str]) -> None:
            for rid in ids:
                i = int(rid[1:])
                p = Sampling(temperature=0, max_tokens=6 + i, ignore_eos=True)
                loop.submit(EngineRequest(rid, prompts[rid], p))

        threads = [threading.Thread(target=submit, args=(list(prompts)[k::4],)) for k in range(4)]
        long = Sampling(temperature=0, max_tokens=200, ignore_eos=True)
        loop.submit(EngineRequest("long", _prompt(5), long))
        loop.submit(EngineRequest("bad", _prompt(300), Sampling()))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loop.abort("long")
        assert done.wait(30), f"not all finished: {sorted(got)}"
    finally:
        loop.stop()
    assert not loop._thread.is_alive()
    for rid, want_toks in want.items():
        assert _toks(got[rid]) == want_toks, rid
        assert got[rid][-1].finish_reason == "length"
    assert got["bad"][-1].finish_reason == "error"
    assert got["long"][-1].finish_reason == "abort"
    assert len(_toks(got["long"])) < 200
    assert engine.stats().blocks_used == 0
    assert loop.stats().blocks_used == 0


def test_prefix_hit_gives_the_same_tokens_as_a_cold_run(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A request whose prompt prefix is cached computes only the rest, and generates
    exactly what a cold run generates (greedy and seeded)."""
    from kvbm.protocol import Sampling
    from tasks.settings import engine_config
    from workers.engine import Engine
    from workers.engine_api import EngineRequest

    def run(e: Engine, rid: str, prompt: list[int], sp: Sampling) -> tuple[list, int]:
        e.add_request(EngineRequest(rid, prompt, sp))
        toks, cached = [], -1
        while e.has_unfinished:
            for o in e.step():
                toks += o.token_ids
                if o.finished:
                    cached = o.num_cached_tokens
        return toks, cached

    prompt = [1] + [(7 * i) % 500 + 5 for i in range(70)]  # 71 tokens: 4 full blocks
    greedy = Sampling(max_tokens=20, temperature=0, ignore_eos=True)
    seeded = Sampling(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    for sp in (greedy, seeded):
        cold = Engine.from_model_dir(tiny_model_dir, engine_config(enable_prefix_caching=False))
        want, c0 = run(cold, "cold", prompt, sp)
        warm = Engine.from_model_dir(tiny_model_dir, engine_config())
        first, c1 = run(warm, "a", prompt, sp)
        again, c2 = run(warm, "b", prompt, sp)
        branch, c3 = run(warm, "c", prompt[:40] + [9, 9, 9], sp)
        assert (c0, c1, c2, c3) == (0, 0, 64, 32)
        assert first == want and again == want
        assert warm.stats().blocks_used == 0
        cold_branch, _ = run(cold, "cb", prompt[:40] + [9, 9, 9], sp)
        assert branch == cold_branch


def test_scheduler_delay_holds_prompts_while_others_decode(make_engine) -> None:
    """scheduler_delay_factor: a prompt arriving while another sequence decodes waits
    (factor x the last prefill step) and then runs to the same greedy tokens; with nothing
    decoding it starts at once."""
    params = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = _run(_add(make_engine(), "b", _prompt(20, seed=2), params))["b"]

    engine = make_engine(scheduler_delay_factor=1e6)  # the wait never passes by itself
    _add(engine, "a", _prompt(20, seed=1), params)
    engine.step()  # nothing decodes yet: "a" is admitted and prefilled at once
    assert [s.id for s in engine.scheduler.running] == ["a"] and engine.scheduler.last_prefill_s > 0
    _add(engine, "b", _prompt(20, seed=2), params)
    for _ in range(3):
        outs = engine.step()
        assert [o.request_id for o in outs] == ["a"]  # "a" decodes; "b" waits
    assert [s.id for s in engine.scheduler.waiting] == ["b"]
    engine.config.scheduler_delay_factor = 0.0  # the delay passed
    outs = _run(engine)
    assert _toks(outs["b"]) == _toks(ref)
    assert not engine.scheduler.waiting


# ------------------------------------------------------------------------ prefix cache reset


def test_reset_prefix_cache_is_refused_while_a_request_holds_blocks(make_engine) -> None:
    engine = make_engine()
    p = Sampling(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = _prompt(40)
    first = _toks(_one(engine, prompt, p))
    assert engine.cached_block_hashes()  # the prompt's blocks stay cached
    warm = _run(_add(engine, "warm", prompt, p))["warm"]
    assert warm[-1].num_cached_tokens > 0  # and serve it again
    _add(engine, "busy", _prompt(20, seed=3), p)
    engine.step()  # it holds blocks now
    assert engine.reset_prefix_cache() is False and engine.cached_block_hashes()
    _run(engine)
    assert engine.reset_prefix_cache() is True and engine.cached_block_hashes() == []
    removed = [e for e in engine.take_kv_events() if e.kind == "removed"]
    assert removed  # the router's index hears of it
    again = _run(_add(engine, "again", prompt, p))["again"]
    assert _toks(again) == first  # computed again, the same tokens
    assert again[-1].num_cached_tokens == 0
