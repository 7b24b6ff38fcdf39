"""The thinking budget (workers.thinking, vLLM's thinking_token_budget): where a
sequence stands against it, token by token, and the forced end in the logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbm.protocol import Sampling, ThinkingBudget
from workers.engine_api import EngineRequest
from workers.logits import process
from workers.scheduler import Seq
from workers.thinking import ThinkingState

START, END = [5, 6], [7, 8]  # two-token markers: a marker spans tokens


def _budget(n: int, end: list[int] = END, natural: list[int] = END) -> ThinkingBudget:
    return ThinkingBudget(budget=n, start=START, end=end, natural_end=natural)


def _run(state: ThinkingState, model: list[int]) -> list[int]:
    """The output a model that would give ``model`` gives under the budget: each step the
    forced token if any, else the model's next."""
    out: list[int] = []
    for tok in model:
        forced = state.forced(out)
        out.append(tok if forced is None else forced)
    return out


@pytest.mark.parametrize(
    ("prompt", "budget", "want"),
    [
        ([1, 5, 6], 3, [9, 9, 9, 7, 8, 9, 9]),  # the prompt opens the block
        ([1, 5, 6, 2], 3, [9, 9, 7, 8, 9, 9, 9]),  # one thinking token in the prompt
        ([1, 5, 6], 0, [7, 8, 9, 9, 9, 9, 9]),  # no thinking at all
        ([1, 5, 6, 2, 2, 2, 2], 3, [7, 8, 9, 9, 9, 9, 9]),  # spent in the prompt
        ([5, 6, 9, 7, 8], 0, [9] * 7),  # the prompt's block is closed: an answer
        ([1, 2], 0, [9] * 7),  # no block at all
    ],
)
def test_the_prompt_counts(prompt: list[int], budget: int, want: list[int]) -> None:
    assert _run(ThinkingState(_budget(budget), prompt), [9] * 7) == want


def test_blocks_the_model_opens_and_closes_in_its_output() -> None:
    model = [9, 5, 6, 9, 9, 9, 9, 9, 5, 6, 9, 7, 8, 9, 9]
    got = _run(ThinkingState(_budget(3), [1]), model)
    # the first block is cut after 3 tokens; the second closes itself after 1: each block
    # has its own count
    assert got == [9, 5, 6, 9, 9, 9, 7, 8, 5, 6, 9, 7, 8, 9, 9]
    # a budget the model stays within changes nothing (its one block, as it closes it
    # itself, holds 9 tokens: a start marker inside a block is thinking text)
    assert _run(ThinkingState(_budget(10), [1]), model) == model
    assert _run(ThinkingState(_budget(8), [1]), model) == model  # forced as it was written
    # spent with the end half written (its 7 counted): the forced end goes on with its 8
    assert _run(ThinkingState(_budget(9), [1]), model) == model


def test_the_forced_end_may_differ_from_the_natural_one() -> None:
    # a phrase before </think> (vLLM's reasoning_end_str), the block closed by it
    st = ThinkingState(_budget(1, end=[3, 4, 7, 8]), [5, 6])
    assert _run(st, [9] * 7) == [9, 3, 4, 7, 8, 9, 9]


def test_reads_only_what_it_has_not_read() -> None:
    st = ThinkingState(_budget(2), [5, 6])
    out = [9]
    assert st.forced(out) is None and st.seen == 1
    out.append(9)
    assert st.forced(out) == 7 and st.forced(out) == 7  # asked again: the same
    out.append(7)
    assert st.forced(out) == 8
    out.append(8)
    assert st.forced(out) is None and not st.inside


def test_the_logits_keep_only_the_forced_token() -> None:
    spent = Seq(EngineRequest("a", [5, 6], Sampling(thinking=_budget(1))), None, None,  # type: ignore[arg-type]
                [5, 6, 9], 2, output_ids=[9])  # fmt: skip
    within = Seq(EngineRequest("b", [5, 6], Sampling(thinking=_budget(4))), None, None,  # type: ignore[arg-type]
                 [5, 6, 9], 2, output_ids=[9])  # fmt: skip
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    with torch.inference_mode():
        process(logits, [spent, within], [[], []])
    assert logits[0].argmax().item() == 7 and torch.isinf(logits[0]).sum().item() == 11
    assert torch.equal(logits[1], before[1])


def test_a_budget_keeps_the_request_off_speculation() -> None:
    assert Sampling(thinking=_budget(1)).processed and not Sampling().processed


def test_the_vllm_engine_gets_the_same_markers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from tasks.cli import _vllm_options
    from tasks.settings import Settings
    from workers.vllm_engine import vllm_argv

    assert "reasoning_config" not in _vllm_options(Settings(model=tiny_model_dir))
    # a tokenizer without <think> as a token: vLLM's parsers would not start; the markers
    # go as strings (the thinking budget), a grammar applies from the first token there
    argv = vllm_argv(_vllm_options(Settings(model=tiny_model_dir, reasoning_parser="qwen3")))
    assert argv == ['--reasoning-config={"reasoning_start_str": "<think>", '
                    '"reasoning_end_str": "</think>"}']  # fmt: skip
    # one with both tags as tokens (a reasoning model's): vLLM's own parser
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens(["<think>", "</think>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = vllm_argv(_vllm_options(Settings(model=tmp_path, reasoning_parser="qwen3")))
    assert argv == ["--reasoning-parser=qwen3"]
    phrase = json.dumps({"reasoning_end_str": "Enough.</think>"})
    argv = vllm_argv(_vllm_options(Settings(model=tmp_path, reasoning_parser="qwen3",
                                            reasoning_config=phrase)))  # fmt: skip
    assert argv == ["--reasoning-parser=qwen3", '--reasoning-config={"reasoning_start_str": '
                    '"<think>", "reasoning_end_str": "Enough.</think>"}']  # fmt: skip
    own = Settings(model=tmp_path, reasoning_parser="qwen3", vllm={"reasoning_parser": "qwen3"})
    assert "reasoning_config" not in _vllm_options(own)  # CONVEYOR_VLLM__* says otherwise
