"""Sampling parameters and the per-step sampler.

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then top-p (nucleus),
drawn from the request's own ``torch.Generator`` — seeded from ``seed`` when given, so the
same request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where sampling runs; the parameters stay torch-free
    import torch


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        names = cls.__dataclass_fields__.keys()  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}  # type: ignore[attr-defined]


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
    banned: list[list[int]],  # ids masked out per row (eos before min_tokens)
) -> list[int]:
    """One token per row."""
    import torch

    out: list[int] = []
    for i, p in enumerate(params):
        row = logits[i]
        if banned[i]:
            row = row.clone()
            row[banned[i]] = float("-inf")
        if p.greedy:
            out.append(int(torch.argmax(row)))
            continue
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out
