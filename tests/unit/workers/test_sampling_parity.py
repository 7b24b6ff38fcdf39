"""The reference engine's logprobs and sampling features against Hugging Face on the same
checkpoints (the default tiny LLaVA and the grouped-query-attention Llama of
test_engine_parity):

* logprobs (output and prompt) equal ``log_softmax`` of HF's logits within 1e-3, with the
  same top tokens and ranks, through chunked prefill, preemption and the prefix cache,
  whatever the request samples with (they are the raw model's);
* ``repetition_penalty`` equals HF ``generate(repetition_penalty=...)`` greedy;
* ``presence_penalty`` / ``frequency_penalty`` equal a reference loop written here (HF
  forward step by step, OpenAI's penalties applied by this file's code);
* ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` change exactly what they say.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from tests.unit.workers.test_engine_parity import _write_gqa_llama
from tests.unit.workers.test_resume_engine import _run as run_outputs
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput

TOL = 1e-3


@dataclass
class Model:
    name: str
    dir: Path
    hf: torch.nn.Module

    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: position i's distribution over token i + 1."""
        with torch.inference_mode():
            logits = self.hf(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    def engine(self, **cfg: object) -> Engine:
        return Engine.from_model_dir(self.dir, engine_config(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llava(tiny_model_dir: Path) -> Model:
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    return Model("llava", tiny_model_dir, hf)


@pytest.fixture(scope="module")
def gqa(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Model:
    d = _write_gqa_llama(tmp_path_factory.mktemp("models") / "gqa-llama", tiny_model_dir)
    return Model("gqa", d, transformers.LlamaForCausalLM.from_pretrained(d).eval())


@pytest.fixture(params=["llava", "gqa"])
def model(request: pytest.FixtureRequest) -> Model:
    return request.getfixturevalue(request.param)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in lengths]


def _run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    outs = run_outputs(engine, reqs)
    assert engine.stats().blocks_used == 0
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _check_logprob(lp: list, row: torch.Tensor, token: int, k: int, where: str) -> None:
    """One kvbm.protocol.Logprob against HF's log-softmax row for ``token``."""
    value, rank, top = lp
    want = row[token].item()
    assert abs(value - want) < TOL, (where, value, want)
    # the rank, up to tokens HF puts within the tolerance of this one
    assert (row > want + TOL).sum().item() < rank <= (row >= want - TOL).sum().item(), where
    assert len(top) == k, where
    hf_top = row.topk(k)
    assert [x for _, x in top] == sorted((x for _, x in top), reverse=True), where
    for (tid, x), hv, hid in zip(top, hf_top.values.tolist(), hf_top.indices.tolist(),
                                 strict=True):  # fmt: skip
        assert abs(x - hv) < TOL and abs(row[tid].item() - x) < TOL, (where, tid, hid)


def _check_request(model: Model, prompt: list[int], outs: list[RequestOutput],
                   k: int | None, pk: int | None) -> None:  # fmt: skip
    toks = _tokens(outs)
    lsm = model.log_softmax(prompt + toks)
    n = len(prompt)
    if k is None:
        assert all(o.logprobs is None for o in outs)
    else:
        lps = [lp for o in outs for lp in (o.logprobs or [])]
        assert len(lps) == len(toks), "one logprob per output token"
        for j, (tok, lp) in enumerate(zip(toks, lps, strict=True)):
            _check_logprob(lp, lsm[n - 1 + j], tok, k, f"{model.name} output {j}")
    first, *rest = outs
    assert all(o.prompt_logprobs is None for o in rest), "prompt logprobs only once"
    if pk is None:
        assert first.prompt_logprobs is None
        return
    plps = first.prompt_logprobs
    assert plps is not None and len(plps) == n and plps[0] is None
    for i in range(1, n):
        _check_logprob(plps[i], lsm[i - 1], prompt[i], pk, f"{model.name} prompt {i}")


CONFIGS = {
    # prompts prefilled in 24-token chunks alongside other requests' decodes
    "chunked": dict(max_num_batched_tokens=24, num_kv_blocks=256, max_num_seqs=8),
    # a pool so small that requests are preempted and recomputed
    "preempting": dict(
        max_num_batched_tokens=64,
        num_kv_blocks=14,
        block_size=16,
        max_model_len=160,
        max_num_seqs=8,
    ),  # fmt: skip
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_logprobs_equal_hf_log_softmax(model: Model, config: str) -> None:
    prompts = _prompts(5, [1, 2, 9, 17, 33, 50, 71, 90])
    asks = [  # (logprobs, prompt_logprobs, other sampling fields)
        (5, 3, {}),
        (0, 0, {}),
        (None, 4, {}),
        (2, None, {"temperature": 1.0, "seed": 7}),
        (20, 20, {"repetition_penalty": 1.7, "presence_penalty": 1.0}),  # raw: unchanged
        (None, None, {}),
        (3, 2, {"temperature": 0.6, "top_k": 5, "seed": 3, "logit_bias": {40: 5.0}}),
        (1, 1, {}),
    ]
    reqs = [
        EngineRequest(str(i), p, Sampling(**{"temperature": 0.0, **kw}, max_tokens=6 + i,
                                          ignore_eos=True, logprobs=k, prompt_logprobs=pk))
        for i, (p, (k, pk, kw)) in enumerate(zip(prompts, asks, strict=True))
    ]  # fmt: skip
    engine = model.engine(**CONFIGS[config])
    outs = _run(engine, reqs)
    if config == "preempting":
        assert engine.stats().preemptions > 0
    for i, (p, (k, pk, _)) in enumerate(zip(prompts, asks, strict=True)):
        _check_request(model, p, outs[str(i)], k, pk)


def test_prompt_logprobs_compute_the_whole_prompt_and_leave_it_cached(llava: Model) -> None:
    prompt = _prompts(9, [70])[0]
    engine = llava.engine(num_kv_blocks=64, max_model_len=256)

    def once(rid: str, **kw: object) -> list[RequestOutput]:
        params = Sampling(temperature=0, max_tokens=3, ignore_eos=True, **kw)  # type: ignore[arg-type]
        return _run(engine, [EngineRequest(rid, prompt, params)])[rid]

    assert once("warm")[-1].num_cached_tokens == 0
    asked = once("asked", prompt_logprobs=2)
    assert asked[-1].num_cached_tokens == 0  # no prefix-cache hit for it, as in vLLM
    _check_request(llava, prompt, asked, None, 2)
    # a cached prefix stays usable by the others (64 of the 70 tokens: 4 full blocks)
    assert once("after")[-1].num_cached_tokens == 64


def test_repetition_penalty_equals_hf_generate(model: Model) -> None:
    prompts = _prompts(13, [4, 12, 30, 57])
    for penalty in (1.3, 0.8):
        want = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                seq = model.hf.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=20, do_sample=False,
                                        repetition_penalty=penalty,
                                        eos_token_id=None)  # fmt: skip
                want.append(seq[0, len(p) :].tolist())
        params = Sampling(temperature=0, max_tokens=20, ignore_eos=True,
                          repetition_penalty=penalty)  # fmt: skip
        outs = _run(model.engine(max_num_batched_tokens=32),
                    [EngineRequest(str(i), p, params) for i, p in enumerate(prompts)])  # fmt: skip
        got = [_tokens(outs[str(i)]) for i in range(len(prompts))]
        assert got == want, penalty
    plain = _run(model.engine(), [EngineRequest("p", prompts[1], Sampling(
        temperature=0, max_tokens=20, ignore_eos=True))])  # fmt: skip
    assert _tokens(plain["p"]) != got[1], "the penalty changed nothing"


def _reference_penalized(model: Model, prompt: list[int], n: int, presence: float,
                         frequency: float) -> list[int]:  # fmt: skip
    """Greedy decoding with OpenAI's penalties, written out: HF's whole forward at every
    step, then logit[t] -= frequency * count(t in output) + presence * (t in output)."""
    out: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            last = model.hf(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        logits = last.float().clone()  # out of inference mode: a tensor to change
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.9), (-0.7, 1.3)])
def test_presence_and_frequency_penalties_equal_a_reference_loop(
    model: Model, presence: float, frequency: float
) -> None:
    prompts = _prompts(17, [3, 21, 40])
    params = Sampling(temperature=0, max_tokens=16, ignore_eos=True,
                      presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
    outs = _run(model.engine(max_num_batched_tokens=16),
                [EngineRequest(str(i), p, params) for i, p in enumerate(prompts)])  # fmt: skip
    for i, p in enumerate(prompts):
        assert _tokens(outs[str(i)]) == _reference_penalized(model, p, 16, presence, frequency)


def _greedy_with_top(engine: Engine, prompt: list[int], n: int, **kw: object):  # type: ignore[no-untyped-def]
    """Greedy tokens and each step's top-5 (id, logprob)."""
    params = Sampling(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5, **kw)  # type: ignore[arg-type]
    outs = _run(engine, [EngineRequest("g", prompt, params)])["g"]
    return _tokens(outs), [lp[2] for o in outs for lp in o.logprobs or []]


def test_logit_bias_allowed_ids_and_bad_words_change_exactly_what_they_say(llava: Model) -> None:
    engine = llava.engine()
    prompt = _prompts(21, [25])[0]
    base, top = _greedy_with_top(engine, prompt, 8)
    # logit_bias: +100 makes a token win every step; the logprobs stay the model's
    forced = top[0][3][0]
    toks, top_b = _greedy_with_top(engine, prompt, 8, logit_bias={forced: 100.0})
    assert toks == [forced] * 8
    assert [t for t, _ in top_b[0]] == [t for t, _ in top[0]]
    assert [x for _, x in top_b[0]] == pytest.approx([x for _, x in top[0]], abs=TOL)
    # allowed_token_ids: the best allowed token at each step, by the model's own logprobs
    allowed = sorted({t for step in top for t, _ in step[1:4]})
    toks, top_a = _greedy_with_top(engine, prompt, 8, allowed_token_ids=allowed)
    assert set(toks) <= set(allowed)
    lsm = llava.log_softmax(prompt + toks)
    for j, t in enumerate(toks):
        row = lsm[len(prompt) - 1 + j]
        assert t == allowed[int(row[allowed].argmax())], j
    # bad_words: a one-token word is never picked (the runner-up is instead)
    toks, _ = _greedy_with_top(engine, prompt, 8, bad_words=[[base[0]]])
    assert base[0] not in toks and toks[0] == top[0][1][0]
    # a two-token word: its first token may come; its second not right after it
    toks, _ = _greedy_with_top(engine, prompt, 8, bad_words=[[base[0], base[1]]])
    assert toks[0] == base[0] and toks[1] == top[1][1][0] != base[1]
    for a, b in zip(toks, toks[1:], strict=False):
        assert (a, b) != (base[0], base[1])
