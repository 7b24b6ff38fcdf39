"""Speculative decoding by n-gram lookup (workers.spec_decode) in the reference engine:
greedy outputs token for token those of the same engine without it (and so Hugging Face's
generate: tests/unit/workers/test_engine_parity.py), in mixed batches beside requests it
does not serve, with the drafts' KV given back; sampled requests through rejection
sampling (rows aligned, seeded runs reproducible, the distribution kept); the proposer, the
acceptance rule and the configuration on their own."""

from __future__ import annotations

import pytest

from kvbm.protocol import Sampling
from tasks.settings import Settings, engine_config
from tests.unit.workers.test_engine import _run as run_all
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.spec_decode import NgramIndex, PredictionTracker, SpecConfig, accepted

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip


def _engine(model_and_tok, spec: dict | None, **kw: object) -> Engine:  # type: ignore[no-untyped-def]
    cfg = engine_config(num_kv_blocks=kw.pop("num_kv_blocks", 96), max_model_len=512,
                        speculative_config=spec, **kw)  # type: ignore[arg-type]  # fmt: skip
    return Engine(*model_and_tok, cfg)


def _run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    """``reqs`` run to the end (every block given back: test_engine's _run)."""
    for r in reqs:
        assert engine.add_request(r) is None
    return run_all(engine)


def _prompt(n: int, seed: int) -> list[int]:
    return [1] + [5 + (seed * 131 + i * 37) % 507 for i in range(n - 1)]


def _reqs() -> list[EngineRequest]:
    """Greedy requests (some with a repeated phrase, so drafts are found in the prompt),
    and others speculation does not serve, in one batch."""
    phrase = [17, 230, 44, 91, 300, 12]
    out = []
    for i in range(8):
        prompt = _prompt(20 + 9 * i, i) + phrase * (1 + i % 3)
        out.append(EngineRequest(f"g{i}", prompt, Sampling(max_tokens=24 + i, temperature=0,
                                                           ignore_eos=True)))  # fmt: skip
    out.append(EngineRequest("stop", _prompt(30, 9) + phrase * 2,
                             Sampling(max_tokens=40, temperature=0, stop=["e"])))  # fmt: skip
    out.append(
        EngineRequest(
            "pen",
            _prompt(25, 10) + phrase,
            Sampling(max_tokens=20, temperature=0, presence_penalty=0.5),
        )
    )
    out.append(EngineRequest("hot", _prompt(25, 11), Sampling(max_tokens=20, temperature=0.9,
                                                             seed=3)))  # fmt: skip
    out.append(
        EngineRequest(
            "lp", _prompt(25, 12) + phrase, Sampling(max_tokens=12, temperature=0, logprobs=2)
        )
    )
    return out


def _tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in os_ for t in o.token_ids] for rid, os_ in outs.items()}


def _text(outs: dict[str, list[RequestOutput]]) -> dict[str, str]:
    return {rid: "".join(o.text for o in os_) for rid, os_ in outs.items()}


@pytest.mark.parametrize("attention", ["auto", "torch"])  # the C decode kernel, and torch's
def test_greedy_outputs_are_those_without_speculation(model_and_tok, attention: str) -> None:  # type: ignore[no-untyped-def]
    plain = _run(_engine(model_and_tok, None), _reqs())
    e = _engine(model_and_tok, SPEC, decode_attention=attention)
    spec = _run(e, _reqs())
    hot = (spec.pop("hot"), plain.pop("hot"))  # sampled: the same distribution, not draws
    assert len(hot[0][-1].token_ids) > 0 and hot[0][-1].num_output_tokens == 20
    assert _tokens(spec) == _tokens(plain)
    assert _text(spec) == _text(plain)
    for rid in plain:
        a, b = plain[rid][-1], spec[rid][-1]
        assert (a.finish_reason, a.stop_reason, a.num_output_tokens) == \
            (b.finish_reason, b.stop_reason, b.num_output_tokens)  # fmt: skip
    st = e.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens
    # it paid: fewer steps for the same tokens
    assert st.steps < _steps(model_and_tok)
    assert st.decode_tokens == sum(len(t) for t in _tokens(spec).values()) + 20


def _steps(model_and_tok) -> int:  # type: ignore[no-untyped-def]
    e = _engine(model_and_tok, None)
    _run(e, _reqs())
    return e.stats().steps


def test_drafts_under_a_tight_kv_pool_and_preemption(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    """A pool too small for every draft: drafts that find no room are skipped, sequences
    are preempted and recomputed, and the tokens are still those without speculation."""
    kw = {"num_kv_blocks": 32, "max_num_seqs": 8}
    plain = _tokens(_run(_engine(model_and_tok, None, **kw), _reqs()))
    e = _engine(model_and_tok, SPEC, **kw)
    got = _tokens(_run(e, _reqs()))
    got.pop("hot"), plain.pop("hot")  # sampled (test_sampled_requests_...)
    assert got == plain
    assert e.stats().preemptions > 0


def test_prefix_cache_after_speculation_gives_the_same_tokens(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    """Blocks a speculating sequence named are cached with the tokens they hold: a second
    request whose prompt is the first's prompt + output hits them and goes on alike."""
    e = _engine(model_and_tok, SPEC)
    base = _reqs()[2]
    first = _tokens(_run(e, [base]))[base.request_id]
    longer = base.prompt_token_ids + first
    again = EngineRequest("again", longer, Sampling(max_tokens=10, temperature=0, ignore_eos=True))
    cached = _run(e, [again])["again"]
    fresh = _run(_engine(model_and_tok, None), [again])["again"]
    assert cached[-1].num_cached_tokens >= 32
    assert _tokens({"x": cached}) == _tokens({"x": fresh})


def _sampled(top_k: int, seed: int | None) -> list[EngineRequest]:
    phrase = [17, 230, 44, 91, 300, 12]
    return [EngineRequest(f"s{i}", _prompt(20 + 7 * i, i) + phrase * (2 + i % 2),
                          Sampling(max_tokens=30, temperature=1.0, top_k=top_k, seed=seed,
                                   ignore_eos=True))
            for i in range(4)]  # fmt: skip


def test_sampled_requests_speculate_with_the_rows_aligned(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    """Sampled at temperature 1 with top_k 1 (so the distribution is the argmax alone): by
    rejection sampling every draft the argmax agrees with is accepted and every other one
    replaced by the argmax, so the tokens are the greedy ones; and drafts were accepted."""
    greedy = [EngineRequest(r.request_id, r.prompt_token_ids,
                            Sampling(max_tokens=30, temperature=0, ignore_eos=True))
              for r in _sampled(1, None)]  # fmt: skip
    want = _tokens(_run(_engine(model_and_tok, None), greedy))
    e = _engine(model_and_tok, SPEC)
    assert _tokens(_run(e, _sampled(1, None))) == want
    st = e.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens
    assert st.steps < 30  # several tokens a step


def test_a_seeded_sampled_request_reproduces_itself(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    runs = [_tokens(_run(_engine(model_and_tok, SPEC), _sampled(0, 7))) for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 30 for t in runs[0].values())
    other = _tokens(_run(_engine(model_and_tok, SPEC), _sampled(0, 8)))
    assert other != runs[0]


def test_rejection_sampling_keeps_the_distribution() -> None:
    """speculative_picks over many draws: the first token is distributed as the model's
    first distribution, and after an accepted first draft the next as its second."""
    import torch

    from workers.sampling import speculative_picks

    probs = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.3], [0.25] * 4])
    drafts = [1, 3]
    g = torch.Generator().manual_seed(1)
    n = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    for _ in range(n):
        picks = speculative_picks(probs, drafts, lambda i: g)
        first[picks[0]] += 1
        if picks[0] == drafts[0]:
            second[picks[1]] += 1
    torch.testing.assert_close(first / n, probs[0], atol=0.015, rtol=0)
    torch.testing.assert_close(second / second.sum(), probs[1], atol=0.02, rtol=0)
    # a certain draft is always taken; an impossible one never
    sure = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert speculative_picks(sure, [1], lambda i: g) == [1, 0]
    assert speculative_picks(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), [1], lambda i: g) == [0, 0]


def test_the_proposer() -> None:
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 4, 5, 2, 3]
    assert idx.propose(toks, 3) == [4, 5, 2]  # "2 3" seen before: what followed it
    toks += [4, 9]
    assert idx.propose(toks, 2) == []  # "9" never seen, nor "4 9", "5 ... 9"
    toks += [1, 2]
    assert idx.propose(toks, 4) == [3, 4, 5, 2]  # the longest match first ("1 2")
    assert NgramIndex(2, 3).propose([7], 3) == []


def test_acceptance() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all, then the bonus token
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # up to the first miss, the model's
    assert accepted([5], [4, 1]) == [4]


def test_the_configuration() -> None:
    assert SpecConfig.parse(None) is None
    assert SpecConfig.parse({"num_speculative_tokens": 3}) == SpecConfig(3, 4, 2)
    for bad, why in [({"method": "eagle", "num_speculative_tokens": 2}, "not served"),
                     ({"num_speculative_tokens": 0}, "1 to 16"),
                     ({"num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup"),
                     ({"num_speculative_tokens": 2, "model": "x"}, "unknown")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            SpecConfig.parse(bad)
    # the settings check the ngram method at start; other methods are the vLLM engine's
    with pytest.raises(ValueError, match="1 to 16"):
        Settings(speculative_config='{"num_speculative_tokens": 99}')
    s = Settings(speculative_config={"method": "eagle", "model": "m", "num_speculative_tokens": 2})
    assert s.engine.speculative_config["method"] == "eagle"  # type: ignore[index]


def test_the_vllm_engine_gets_the_same_setting_as_its_flag() -> None:
    from tasks.cli import _vllm_options
    from workers.vllm_engine import vllm_argv

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert vllm_argv(_vllm_options(Settings(speculative_config=spec))) == [
        '--speculative-config={"method": "ngram", "num_speculative_tokens": 2}'
    ]
    own = {"method": "eagle", "model": "m", "num_speculative_tokens": 3}
    s = Settings(speculative_config=spec, vllm={"speculative_config": own})
    assert _vllm_options(s)["speculative_config"] == own  # CONVEYOR_VLLM__* says more
    assert "speculative_config" not in _vllm_options(Settings())


# --------------------------------------------------------------------------------------
# Predicted outputs (OpenAI's ``prediction``)


def _predicted(rid: str, prompt: list[int], prediction: list[int] | None, n: int,
               **kw: object) -> EngineRequest:  # fmt: skip
    return EngineRequest(rid, prompt, Sampling(max_tokens=n, temperature=0, ignore_eos=True,
                                               prediction=prediction, **kw))  # type: ignore[arg-type]  # fmt: skip


def test_a_prediction_drafts_without_a_speculative_config(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    """The same greedy tokens with a prediction as without one; a prediction that is the
    output itself has (nearly) all its drafts accepted, one with an edit in the middle
    finds its place again after it, and one of other tokens has its drafts rejected."""
    n = 40
    prompt = _prompt(30, 3)
    (want,) = _tokens(_run(_engine(model_and_tok, None), [_predicted("p", prompt, None, n)])
                      ).values()  # fmt: skip
    edited = want[:15] + [7, 8, 9] + want[18:]  # three tokens of the middle changed
    other = _prompt(n, 8)[1:]
    e = _engine(model_and_tok, None)
    outs = _run(e, [_predicted("same", prompt, want, n), _predicted("edit", prompt, edited, n),
                    _predicted("other", prompt, other, n),
                    _predicted("lp", prompt, want, n, logprobs=1)])  # fmt: skip
    assert all(toks == want for toks in _tokens(outs).values())
    pred = {rid: os_[-1].prediction for rid, os_ in outs.items()}
    acc, rej = pred["same"]  # type: ignore[misc]
    # every draft right: each step after the first gives its drafts and one token more
    assert rej == 0 and acc == n - len(outs["same"]) and len(outs["same"]) <= n / 8 + 1
    acc_e, rej_e = pred["edit"]  # type: ignore[misc]
    assert rej_e > 0 and acc_e >= n - 2 - 3 - 8  # lost at the edit, found again after it
    assert pred["other"] is not None and pred["other"][0] < 5  # type: ignore[index]
    assert pred["lp"] is None  # logprobs: one token a step, no drafts
    assert e.spec_stats.drafts > 0


def test_the_prediction_tracker() -> None:
    t = PredictionTracker([10, 11, 12, 13, 14, 15, 16, 17])
    assert t.propose([], 3) == [10, 11, 12]
    assert t.propose([10, 11], 3) == [12, 13, 14]
    # an edit (99 for 12): its tail is nowhere, so a substitution is guessed
    assert t.propose([10, 11, 99], 3) == [13, 14, 15]
    assert t.propose([10, 11, 99, 13, 14], 2) == [15, 16]  # and it was one
    # a deletion (15, 16 gone): found again after "14 17"... at its end
    assert t.propose([10, 11, 99, 13, 14, 17], 4) == []
    ins = PredictionTracker([1, 2, 3, 4, 5, 6, 7, 8])
    assert ins.propose([1, 2, 50, 51, 3, 4], 2) == [5, 6]  # an insertion: found by "3 4"
    rep = PredictionTracker([1, 2, 3, 1, 2, 4])  # an n-gram twice: the place after the last
    assert rep.propose([1, 2, 3], 2) == [1, 2]
    assert rep.propose([1, 2, 3, 1, 2, 9, 1, 2], 2) == [4]  # the later "1 2", not the first
