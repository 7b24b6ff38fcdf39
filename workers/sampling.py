"""The per-step sampler (the parameters are :class:`kvbm.protocol.Sampling`).

Its input is a step's logits as whoever came before left them (structured-output masks,
:func:`workers.logits.process`). Greedy rows (``temperature == 0``) take the argmax;
the others are divided by their temperature, then min-p drops the tokens less likely than
``min_p`` times the most likely one (these two batched over the rows), then top-k, then
top-p (nucleus), drawn from the request's own ``torch.Generator`` — seeded from ``seed``
when given, so the same request gives the same tokens whatever else shares its batch.
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
    logits: torch.Tensor,  # [S, V] float32, processed
    params: list[Sampling],
    generators: list[torch.Generator],
) -> list[int]:
    """One token per row."""
    import torch

    out = [0] * len(params)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) < len(params):
        best = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy:
                out[i] = best[i]
    if not drawn:
        return out
    temps = torch.tensor([params[i].temperature for i in drawn], dtype=logits.dtype)
    x = logits[torch.tensor(drawn, dtype=torch.long)] / temps[:, None]
    min_p = [j for j, i in enumerate(drawn) if params[i].min_p > 0.0]
    if min_p:
        rows = torch.tensor(min_p, dtype=torch.long)
        probs = torch.softmax(x[rows], dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(
            [params[drawn[j]].min_p for j in min_p], dtype=probs.dtype)[:, None]  # fmt: skip
        x[rows] = x[rows].masked_fill(probs < floor, float("-inf"))
    for j, i in enumerate(drawn):
        p, row = params[i], x[j]
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
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out
