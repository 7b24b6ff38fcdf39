"""The per-step sampler (the parameters are :class:`kvbm.protocol.Sampling`).

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then top-p (nucleus),
drawn from the request's own ``torch.Generator`` — seeded from ``seed`` when given, so the
same request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where sampling runs
    import torch

    from kvbm.protocol import Sampling


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: list[Sampling],
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
