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
from collections.abc import Callable
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
    probs = distributions(logits[torch.tensor(drawn, dtype=torch.long)],
                          [params[i] for i in drawn])  # fmt: skip
    for j, i in enumerate(drawn):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return out


def distributions(logits: torch.Tensor, params: list[Sampling]) -> torch.Tensor:
    """What each row's token is drawn from (none greedy): its logits over its temperature,
    min-p's floor, top-k, then top-p, as probabilities."""
    import torch

    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    x = logits / temps[:, None]
    min_p = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        rows = torch.tensor(min_p, dtype=torch.long)
        probs = torch.softmax(x[rows], dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(
            [params[j].min_p for j in min_p], dtype=probs.dtype)[:, None]  # fmt: skip
        x[rows] = x[rows].masked_fill(probs < floor, float("-inf"))
    out = torch.empty_like(x)
    for j, p in enumerate(params):
        row = x[j]
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
        out[j] = probs
    return out


def speculative_picks(probs: torch.Tensor, drafts: list[int],
                      draw: Callable[[int], torch.Generator]) -> list[int]:  # fmt: skip
    """Rejection sampling of n-gram drafts (a draft's proposal is certain: it is accepted
    with its probability under the model, else the token is drawn from the model's
    distribution without it), so the tokens given are distributed as sampling one at a
    time would give them. ``probs``: the distributions at the draft rows and the row after
    the last draft (``len(drafts) + 1`` rows); ``draw(i)``: the generator for the token at
    offset ``i``. Returns one pick per row, as :func:`workers.spec_decode.accepted` reads
    them: the accepted drafts, then the drawn token (later entries repeat it)."""
    import torch

    picks: list[int] = []
    for i, d in enumerate(drafts):
        g = draw(i)
        p_d = float(probs[i, d])
        if float(torch.rand(1, generator=g)) < p_d:
            picks.append(d)
            continue
        rest = probs[i].clone()
        rest[d] = 0.0
        tok = int(torch.multinomial(rest, 1, generator=g)) if p_d < 1.0 else d
        return picks + [tok] * (len(drafts) + 1 - len(picks))
    picks.append(int(torch.multinomial(probs[len(drafts)], 1, generator=draw(len(drafts)))))
    return picks
