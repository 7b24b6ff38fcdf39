"""The reference engine's greedy tokens equal Hugging Face ``transformers.generate``.

Two checkpoints: the default tiny LLaVA (hub layout ``language_model.model.*``, MHA) and a
plain ``LlamaForCausalLM`` written by ``transformers`` itself (``model.*`` names,
grouped-query attention 8 heads / 2 kv heads, head_dim != hidden/heads, rope_theta 5e5 in
``rope_parameters``, tied embeddings, non-trivial norm gains). HF runs every prompt alone
(batch 1, no padding); the engine runs them with staggered arrivals, chunked prefill
alongside decodes, and — in one variant — a KV pool so small that it has to preempt; both
variants run each decode-attention path (the C kernel and torch's gather + SDPA).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers import paged_kernel
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.model_init import EOS

# A prompt on which the tiny LLaVA's greedy continuation emits EOS as its 16th token; in
# the parity set it checks that ignore_eos on the engine == eos disabled in HF.
EOS_PROMPT = [1, 78, 183, 256, 279, 154, 50, 268, 428, 158, 111, 366]
EOS_AT = 15

# Lengths (BOS included): 1 token up to 300, hitting 16-token block edges exactly.
LENGTHS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 79, 96, 112]
LENGTHS += [127, 128, 129, 150, 177, 200, 223, 255, 256, 257, 290, 300]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[1] + [rng.randrange(5, 512) for _ in range(n - 1)] for n in LENGTHS]
    rng.shuffle(out)  # arrival order is not sorted by length
    return [EOS_PROMPT, *out]


def _max_tokens(i: int) -> int:
    return 3 + (i * 7) % 22  # 3..24, all different neighbours


@dataclass
class Case:
    name: str
    model_dir: Path
    prompts: list[list[int]]
    max_tokens: list[int]
    hf: list[list[int]]  # HF greedy continuation of each prompt (exactly max_tokens long)


# ------------------------------------------------------------------------- checkpoints


def _write_gqa_llama(out: Path, tokenizer_from: Path) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=3,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:  # gains away from 1 so a dropped norm weight shows
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.06 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    shutil.copy(tokenizer_from / "tokenizer.json", out / "tokenizer.json")
    return out


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: list[int]):
    out = []
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([p])
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=m,
                do_sample=False,
                eos_token_id=None,  # generate exactly m tokens, like ignore_eos
            )
            out.append(seq[0, len(p) :].tolist())
            assert len(out[-1]) == m
    return out


@pytest.fixture(scope="module")
def llava_case(tiny_model_dir: Path) -> Case:
    prompts = _prompts(seed=11)
    max_tokens = [
        max(_max_tokens(i), EOS_AT + 5) if i == 0 else _max_tokens(i) for i in range(len(prompts))
    ]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    hf = _hf_greedy(model, prompts, max_tokens)
    # the EOS prompt really does hit EOS, and HF kept going past it
    assert hf[0][EOS_AT] == EOS and len(hf[0]) > EOS_AT + 1
    return Case("llava", tiny_model_dir, prompts, max_tokens, hf)


@pytest.fixture(scope="module")
def gqa_case(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Case:
    d = _write_gqa_llama(tmp_path_factory.mktemp("models") / "gqa-llama", tiny_model_dir)
    prompts = _prompts(seed=23)
    max_tokens = [_max_tokens(i + 5) for i in range(len(prompts))]
    model = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    hf = _hf_greedy(model, prompts, max_tokens)
    return Case("gqa", d, prompts, max_tokens, hf)


@pytest.fixture(params=["llava", "gqa"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(f"{request.param}_case")


# ------------------------------------------------------------------------------ engine


def _drive(
    engine: Engine,
    case: Case,
    waves: list[int],
    steps_between: int,
) -> dict[str, list[RequestOutput]]:
    """Add requests in waves of the given sizes with ``steps_between`` steps between
    waves, then run to completion. Returns every output per request id."""
    outs: dict[str, list[RequestOutput]] = {}
    pending = list(range(len(case.prompts)))
    waves = list(waves)

    def collect(step_outs: list[RequestOutput]) -> None:
        for o in step_outs:
            outs.setdefault(o.request_id, []).append(o)

    while pending:
        n = waves.pop(0) if waves else len(pending)
        for i in pending[:n]:
            params = Sampling(temperature=0.0, max_tokens=case.max_tokens[i], ignore_eos=True)
            assert engine.add_request(EngineRequest(str(i), case.prompts[i], params)) is None
        pending = pending[n:]
        for _ in range(steps_between):
            collect(engine.step())
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        collect(engine.step())
    assert not engine.has_unfinished
    return outs


def _spy_schedule(engine: Engine) -> list[list[tuple[int, int, int]]]:
    """Record each step's schedule as (num_computed_before, n, num_prompt) per sequence;
    the real scheduler still runs."""
    log: list[list[tuple[int, int, int]]] = []
    real: Callable = engine.scheduler.schedule

    def spy():
        sched = real()
        log.append([(s.num_computed, n, s.num_prompt) for s, n in sched])
        return sched

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return log


def _check(engine: Engine, case: Case, outs: dict[str, list[RequestOutput]]) -> None:
    assert sorted(outs, key=int) == [str(i) for i in range(len(case.prompts))]
    mismatches = []
    for i, want in enumerate(case.hf):
        got_outs = outs[str(i)]
        got = [t for o in got_outs for t in o.token_ids]
        last = got_outs[-1]
        assert last.finished and last.finish_reason == "length", (i, last)
        assert [o.finished for o in got_outs].count(True) == 1
        assert last.num_output_tokens == case.max_tokens[i]
        assert last.num_prompt_tokens == len(case.prompts[i])
        if got != want:
            mismatches.append((i, len(case.prompts[i]), want, got))
    assert not mismatches, (
        f"{case.name}: engine != HF for {len(mismatches)} prompts: {mismatches[:3]}"
    )
    assert engine.stats().blocks_used == 0
    assert engine.scheduler.kv.num_seqs == 0
    assert engine.scheduler.running == [] and len(engine.scheduler.waiting) == 0


@pytest.fixture(params=["kernel", "torch"])
def decode_attention(request: pytest.FixtureRequest) -> str:
    """Both decode-attention paths: the C kernel (skipped, visibly, on a host that cannot
    build it) and the torch gather + SDPA."""
    if request.param == "kernel":
        try:
            paged_kernel.load(Path(engine_config().kernel_dir))
        except paged_kernel.KernelUnavailable as e:
            pytest.skip(f"the C decode-attention kernel cannot be built here: {e}")
    return request.param


def test_parity_staggered_chunked(case: Case, decode_attention: str) -> None:
    engine = Engine.from_model_dir(
        case.model_dir,
        engine_config(
            max_num_batched_tokens=64,
            num_kv_blocks=512,
            max_num_seqs=12,
            decode_attention=decode_attention,
        ),
    )
    assert engine.decode_attention == decode_attention
    sched = _spy_schedule(engine)
    outs = _drive(engine, case, waves=[3, 2, 4, 1, 5, 3], steps_between=4)
    _check(engine, case, outs)
    assert engine.stats().preemptions == 0
    # long prompts were prefilled in several chunks, some of them in steps that also
    # decoded other sequences
    chunked = [s for step in sched for s in step if s[1] > 1 and s[0] > 0]
    mixed = [
        step
        for step in sched
        if any(n > 1 for _, n, _ in step) and any(n == 1 and c >= p for c, n, p in step)
    ]
    assert len(chunked) >= 10
    assert len(mixed) >= 10
    assert max(sum(n for _, n, _ in step) for step in sched) == 64


def test_parity_under_preemption(case: Case, decode_attention: str) -> None:
    engine = Engine.from_model_dir(
        case.model_dir,
        engine_config(
            max_model_len=256,
            num_kv_blocks=20,
            block_size=16,
            max_num_batched_tokens=96,
            max_num_seqs=16,
            decode_attention=decode_attention,
        ),
    )
    assert engine.decode_attention == decode_attention
    keep = [i for i, p in enumerate(case.prompts) if len(p) + case.max_tokens[i] <= 256]
    assert len(keep) >= 25
    sub = Case(
        case.name,
        case.model_dir,
        [case.prompts[i] for i in keep],
        [case.max_tokens[i] for i in keep],
        [case.hf[i] for i in keep],
    )
    outs = _drive(engine, sub, waves=[12, 6], steps_between=6)
    assert engine.stats().preemptions > 0
    _check(engine, sub, outs)


def test_eos_and_min_tokens_match_hf(llava_case: Case) -> None:
    """Without ignore_eos the engine stops where HF stops; min_tokens bans EOS exactly like
    HF's min_new_tokens."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_case.model_dir).eval()
    ids = torch.tensor([EOS_PROMPT])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        hf_stop = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        hf_min = model.generate(
            ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False
        )
    hf_stop = hf_stop[0, len(EOS_PROMPT) :].tolist()
    hf_min = hf_min[0, len(EOS_PROMPT) :].tolist()
    assert hf_stop[-1] == EOS and len(hf_stop) == EOS_AT + 1
    assert EOS not in hf_min and len(hf_min) == 30

    engine = Engine.from_model_dir(
        llava_case.model_dir, engine_config(num_kv_blocks=8, max_model_len=128)
    )
    engine.add_request(EngineRequest("stop", EOS_PROMPT, Sampling(temperature=0, max_tokens=30)))
    engine.add_request(
        EngineRequest("min", EOS_PROMPT, Sampling(temperature=0, max_tokens=30, min_tokens=30))
    )
    toks: dict[str, list[int]] = {"stop": [], "min": []}
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for o in engine.step():
            toks[o.request_id] += o.token_ids
            last[o.request_id] = o
    assert toks["stop"] == hf_stop
    assert (last["stop"].finish_reason, last["stop"].stop_reason) == ("stop", None)
    assert toks["min"] == hf_min
    assert last["min"].finish_reason == "length"
    assert engine.stats().blocks_used == 0
