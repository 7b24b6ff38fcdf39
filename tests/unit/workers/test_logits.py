"""Logits processing (workers.logits.process): each processor's exact effect on its rows,
rows that use none untouched, vLLM's order (masks and biases, then penalties)."""

from __future__ import annotations

import pytest
import torch

from kvbm.protocol import Sampling
from workers.engine_api import EngineRequest
from workers.logits import process
from workers.scheduler import Seq

V = 12


def _seq(prompt: list[int], output: list[int] | None = None, **params: object) -> Seq:
    req = EngineRequest("r", prompt, Sampling(**params))  # type: ignore[arg-type]
    out = list(output or [])
    return Seq(req, None, None, prompt + out, len(prompt), output_ids=out)  # type: ignore[arg-type]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def _run(logits: torch.Tensor, seqs: list[Seq], banned: list[list[int]] | None = None):  # type: ignore[no-untyped-def]
    with torch.inference_mode():  # as the engine runs it
        return process(logits, seqs, banned or [[] for _ in seqs])


def test_rows_that_use_nothing_are_untouched_and_nothing_is_copied() -> None:
    logits = _logits(3)
    before = logits.clone()
    out = _run(logits, [_seq([1, 2]), _seq([3], [4, 4]), _seq([5], temperature=0.3, top_k=2)])
    assert out is logits
    assert torch.equal(out, before)


def test_logit_bias_adds_exactly_to_its_tokens() -> None:
    logits = _logits(2)
    before = logits.clone()
    _run(logits, [_seq([1], logit_bias={3: 5.0, 7: -2.5}), _seq([1])])
    want = before.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 2.5
    assert torch.equal(logits, want)


def test_allowed_token_ids_mask_everything_else() -> None:
    logits = _logits(2)
    before = logits.clone()
    _run(logits, [_seq([1]), _seq([1], allowed_token_ids=[2, 9], logit_bias={9: 1.0, 4: 3.0})])
    assert torch.equal(logits[0], before[0])
    keep = {2: before[1, 2].item(), 9: before[1, 9].item() + 1.0}
    for t in range(V):
        assert logits[1, t].item() == keep.get(t, float("-inf")), t


def test_bad_words_ban_a_last_token_only_after_the_others() -> None:
    words = [[5], [2, 3], [7, 8, 9]]
    cases = [
        ([], {5}),  # one-token words always
        ([1, 2], {5, 3}),  # the output ends with 2: 3 would complete [2, 3]
        ([2, 1], {5}),
        ([7, 8], {5, 9}),
        ([8, 7], {5}),
        ([2, 7, 8], {5, 9}),
    ]
    seqs = [_seq([2, 7, 8], out, bad_words=words) for out, _ in cases]  # the prompt does not count
    logits = _logits(len(cases))
    before = logits.clone()
    _run(logits, seqs)
    for i, (_, banned) in enumerate(cases):
        for t in range(V):
            want = float("-inf") if t in banned else before[i, t].item()
            assert logits[i, t].item() == want, (i, t)


def test_min_tokens_bans_come_in_with_the_rest() -> None:
    logits = _logits(2)
    before = logits.clone()
    _run(logits, [_seq([1], logit_bias={4: 1.0}), _seq([1])], banned=[[4], [0, 11]])
    assert logits[0, 4] == float("-inf") and logits[1, 0] == logits[1, 11] == float("-inf")
    others = [t for t in range(V) if t not in (0, 4, 11)]
    assert torch.equal(logits[:, others], before[:, others])


def _ref_penalties(row: torch.Tensor, prompt: list[int], out: list[int], p: Sampling):
    """OpenAI's presence/frequency (output tokens) after Hugging Face's repetition
    penalty (prompt and output tokens), one token at a time."""
    row = row.clone()
    for t in set(prompt) | set(out):
        x = row[t].item()
        row[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 0.7},
        {"frequency_penalty": 0.4},
        {"frequency_penalty": -0.5, "presence_penalty": 1.5},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6, "presence_penalty": -1.0, "frequency_penalty": 2.0},
    ],
)
def test_penalties_equal_their_definitions(params: dict) -> None:
    prompt, out = [1, 2, 2, 6], [3, 3, 3, 6, 10]
    seqs = [_seq(prompt, out, **params), _seq(prompt, out), _seq([4], [4, 5], **params)]
    logits = _logits(3, seed=3)
    before = logits.clone()
    _run(logits, seqs)
    p = Sampling(**params)
    assert torch.allclose(logits[0], _ref_penalties(before[0], prompt, out, p), atol=1e-6)
    assert torch.equal(logits[1], before[1])
    assert torch.allclose(logits[2], _ref_penalties(before[2], [4], [4, 5], p), atol=1e-6)


def test_penalty_counts_follow_the_output_step_by_step() -> None:
    seq = _seq([1], [], frequency_penalty=1.0)
    for out in ([2], [2, 2], [2, 2, 5]):
        seq.output_ids[:] = out
        logits = torch.zeros(1, V)
        _run(logits, [seq])
        want = torch.zeros(V)
        for t in out:
            want[t] -= 1.0
        assert torch.equal(logits[0], want), out


def test_masks_come_before_penalties() -> None:
    # a banned token stays -inf under any penalty; a biased one is penalized after its bias
    seq = _seq([1], [3], logit_bias={3: 4.0}, bad_words=[[5]], repetition_penalty=2.0)
    logits = torch.ones(1, V)
    _run(logits, [seq])
    assert logits[0, 5] == float("-inf")
    assert logits[0, 3].item() == pytest.approx((1.0 + 4.0) / 2.0)
    assert logits[0, 1].item() == pytest.approx(0.5)  # the prompt's token
    assert logits[0, 2].item() == 1.0
