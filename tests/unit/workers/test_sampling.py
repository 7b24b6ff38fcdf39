"""Sampling validation and the per-row sampler."""

from __future__ import annotations

import pytest
import torch

from kvbm.protocol import Sampling
from workers.sampling import make_generator, sample


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    params = [Sampling(temperature=0.0)] * 6
    out = sample(logits, params, [None] * 6, [[] for _ in range(6)])  # type: ignore[list-item]
    assert out == logits.argmax(dim=-1).tolist()


def test_banned_ids_never_chosen_greedy() -> None:
    logits = _logits(3)
    top2 = logits.topk(2, dim=-1).indices
    banned = [[int(top2[i, 0])] for i in range(3)]
    params = [Sampling(temperature=0.0)] * 3
    out = sample(logits, params, [None] * 3, banned)  # type: ignore[list-item]
    assert out == top2[:, 1].tolist()
    # the caller's logits are untouched
    assert logits.argmax(dim=-1).tolist() == top2[:, 0].tolist()


def test_banned_ids_never_chosen_sampled() -> None:
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 10.0  # overwhelmingly likely unless banned
    banned = [[3, 5]]
    g = make_generator(0)
    p = [Sampling(temperature=1.0)]
    seen = {sample(logits, p, [g], banned)[0] for _ in range(300)}
    assert seen.isdisjoint({3, 5})
    assert seen == {0, 1, 2, 4, 6, 7}


def test_tiny_top_p_is_argmax() -> None:
    logits = _logits(5, seed=1)
    params = [Sampling(temperature=1.0, top_p=1e-6)] * 5
    gens = [make_generator(i) for i in range(5)]
    for _ in range(5):
        out = sample(logits, params, gens, [[] for _ in range(5)])
        assert out == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_argmax() -> None:
    logits = _logits(5, seed=2)
    params = [Sampling(temperature=2.0, top_k=1)] * 5
    gens = [make_generator(i) for i in range(5)]
    out = sample(logits, params, gens, [[] for _ in range(5)])
    assert out == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    g = make_generator(3)
    p = [Sampling(temperature=5.0, top_k=2)]
    seen = {sample(logits, p, [g], [[]])[0] for _ in range(200)}
    assert seen == {4, 5}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two only
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    g = make_generator(4)
    p = [Sampling(temperature=1.0, top_p=0.6)]
    seen = {sample(logits, p, [g], [[]])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_seeded_generator_is_reproducible() -> None:
    logits = _logits(1, vocab=100, seed=5)
    p = [Sampling(temperature=1.0)]
    g1, g2 = make_generator(42), make_generator(42)
    a = [sample(logits, p, [g1], [[]])[0] for _ in range(30)]
    b = [sample(logits, p, [g2], [[]])[0] for _ in range(30)]
    assert a == b
    assert len(set(a)) > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.5},
        {"top_k": -2},
        {"min_tokens": -1},
        {"max_tokens": 4, "min_tokens": 5},
    ],
)
def test_sampling_params_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Sampling(**kwargs)


def test_sampling_params_valid_edges_and_roundtrip() -> None:
    p = Sampling(
        max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_tokens=1, stop=["x"], seed=3
    )
    assert p.greedy
    assert not Sampling(temperature=0.7).greedy
    # what the stage payload carries (JSON) comes back equal; unknown keys are ignored
    assert Sampling.model_validate({**p.model_dump(mode="json"), "unknown_key": 1}) == p
