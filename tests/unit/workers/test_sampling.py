"""Sampling validation and the sampler (temperature, min-p, top-k, top-p, greedy)."""

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
    out = sample(logits, params, [None] * 6)  # type: ignore[list-item]
    assert out == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    logits = _logits(5, seed=1)
    params = [Sampling(temperature=1.0, top_p=1e-6)] * 5
    gens = [make_generator(i) for i in range(5)]
    for _ in range(5):
        out = sample(logits, params, gens)
        assert out == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_argmax() -> None:
    logits = _logits(5, seed=2)
    params = [Sampling(temperature=2.0, top_k=1)] * 5
    gens = [make_generator(i) for i in range(5)]
    out = sample(logits, params, gens)
    assert out == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    g = make_generator(3)
    p = [Sampling(temperature=5.0, top_k=2)]
    seen = {sample(logits, p, [g])[0] for _ in range(200)}
    assert seen == {4, 5}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two only
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    g = make_generator(4)
    p = [Sampling(temperature=1.0, top_p=0.6)]
    seen = {sample(logits, p, [g])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05; min_p=0.2: the floor is 0.1, token 3 is out
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    g = make_generator(5)
    p = [Sampling(temperature=1.0, min_p=0.2)]
    seen = {sample(logits, p, [g])[0] for _ in range(400)}
    assert seen == {0, 1, 2}
    # after temperature: at 0.5 the shares are 0.5^2 : 0.3^2 : ... so 0.15 (0.0225 / 0.25 <
    # 0.2) drops out too
    seen = {sample(logits, [Sampling(temperature=0.5, min_p=0.2)], [g])[0] for _ in range(400)}
    assert seen == {0, 1}


def test_min_p_applies_per_row() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2, 1)
    params = [Sampling(temperature=1.0, min_p=0.5), Sampling(temperature=1.0)]
    gens = [make_generator(6), make_generator(7)]
    seen: list[set[int]] = [set(), set()]
    for _ in range(400):
        a, b = sample(logits, params, gens)
        seen[0].add(a)
        seen[1].add(b)
    assert seen == [{0, 1}, {0, 1, 2, 3}]


def test_greedy_and_drawn_rows_mix() -> None:
    logits = _logits(4, seed=9)
    params = [Sampling(temperature=0.0), Sampling(temperature=1.0, top_k=1)] * 2
    gens = [None, make_generator(1), None, make_generator(2)]
    assert sample(logits, params, gens) == logits.argmax(dim=-1).tolist()  # type: ignore[arg-type]


def test_seeded_generator_is_reproducible() -> None:
    logits = _logits(1, vocab=100, seed=5)
    p = [Sampling(temperature=1.0)]
    g1, g2 = make_generator(42), make_generator(42)
    a = [sample(logits, p, [g1])[0] for _ in range(30)]
    b = [sample(logits, p, [g2])[0] for _ in range(30)]
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
