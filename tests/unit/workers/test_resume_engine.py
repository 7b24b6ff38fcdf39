"""A request resumed on another engine after k output tokens (migration): the rest of its
tokens and text, its usage and finish equal one uninterrupted run, for greedy and seeded
sampling, stop strings, min_tokens and a cut inside a multi-byte character; the second
engine may find the prompt in its prefix cache or not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput, ResumedOutput

CFG = dict(block_size=16, num_kv_blocks=512, max_num_batched_tokens=128, max_model_len=512)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine]:
    make = lambda: Engine.from_model_dir(tiny_model_dir, engine_config(**CFG))  # noqa: E731
    return make(), make()


def _run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for r in reqs:
        assert engine.add_request(r) is None
    out: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id].append(o)
    return out


def _requests(params: list[Sampling], seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 200))]
               for _ in params]  # fmt: skip
    pairs = zip(prompts, params, strict=True)
    return [EngineRequest(f"r{i}", ids, p) for i, (ids, p) in enumerate(pairs)]


def _clone(r: EngineRequest, resumed: ResumedOutput | None = None) -> EngineRequest:
    return EngineRequest(r.request_id, list(r.prompt_token_ids), r.params, resumed=resumed)


@pytest.mark.parametrize("cut", [1, 2, 7, 20])
def test_a_resumed_request_ends_as_the_uninterrupted_one(
    engines: tuple[Engine, Engine], cut: int
) -> None:
    first, second = engines
    params = [
        Sampling(max_tokens=30, temperature=0.9, top_p=0.9, seed=i, stop=["ab", "9"])
        if i % 3 == 1 else
        Sampling(max_tokens=30, temperature=0, min_tokens=(i % 4) * 8, ignore_eos=i % 2 == 0)
        for i in range(18)
    ]  # fmt: skip
    reqs = _requests(params, cut)
    want = _run(first, [_clone(r) for r in reqs])
    resumable = []
    for r in reqs:
        outs = want[r.request_id]
        toks = [t for o in outs for t in o.token_ids]
        if len(toks) <= cut or outs[-1].finish_reason == "error":
            continue  # finished before the cut: nothing to resume
        head = outs[:cut]  # one token per step here: the first `cut` outputs were sent
        sent = "".join(o.text for o in head)
        resumable.append((r, toks, sent, ResumedOutput(toks[:cut], len(sent))))
    assert len(resumable) >= 10, "most requests should run past the cut"
    got = _run(second, [_clone(r, res) for r, _, _, res in resumable])
    for r, toks, sent, _ in resumable:
        outs, mine = want[r.request_id], got[r.request_id]
        assert [t for o in mine for t in o.token_ids] == toks[cut:], r.request_id
        assert sent + "".join(o.text for o in mine) == "".join(o.text for o in outs)
        last, ref = mine[-1], outs[-1]
        assert (last.finish_reason, last.stop_reason) == (ref.finish_reason, ref.stop_reason)
        # usage: the original prompt, every output token once
        assert last.num_prompt_tokens == len(r.prompt_token_ids) == ref.num_prompt_tokens
        assert last.num_output_tokens == len(toks) == ref.num_output_tokens
    for e in engines:
        assert e.stats().blocks_used == 0


def test_a_resumed_request_gives_the_next_logprobs_and_not_the_prompts_again(
    engines: tuple[Engine, Engine],
) -> None:
    """After a migration the new engine recomputes prompt + tokens so far (its prefix
    cache may serve them: no prompt logprobs are owed) and its logprobs for the tokens
    after the cut are the uninterrupted run's."""
    first, second = engines
    cut = 3
    params = [Sampling(max_tokens=10, temperature=0 if i % 2 else 0.7, seed=i, ignore_eos=True,
                       logprobs=i % 3 + 1, prompt_logprobs=2) for i in range(8)]  # fmt: skip
    reqs = _requests(params, 40)
    want = _run(first, [_clone(r) for r in reqs])
    resumed = []
    for r in reqs:
        outs = want[r.request_id]
        assert outs[0].prompt_logprobs is not None
        toks = [t for o in outs for t in o.token_ids]
        sent = "".join(o.text for o in outs[:cut])
        resumed.append(_clone(r, ResumedOutput(toks[:cut], len(sent))))
    got = _run(second, resumed)
    for r in reqs:
        mine, ref = got[r.request_id], want[r.request_id][cut:]
        assert [t for o in mine for t in o.token_ids] == [t for o in ref for t in o.token_ids]
        assert all(o.prompt_logprobs is None for o in mine)
        for o, w in zip(mine, ref, strict=True):
            assert o.logprobs is not None and w.logprobs is not None
            (lp, rank, top), (wlp, wrank, wtop) = o.logprobs[0], w.logprobs[0]
            assert abs(lp - wlp) < 1e-4 and rank == wrank
            assert [t for t, _ in top] == [t for t, _ in wtop]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(top, wtop, strict=True))


def test_resuming_a_request_already_complete_is_an_error(engines: tuple[Engine, Engine]) -> None:
    _, second = engines
    p = Sampling(max_tokens=3, temperature=0)
    out = second.add_request(EngineRequest("done", [1, 5, 6], p,
                                           resumed=ResumedOutput([7, 8, 9], 3)))  # fmt: skip
    assert out is not None and out.finish_reason == "error" and "complete" in (out.error or "")
