"""Logprobs in the reference engine: the model's raw log-softmax (before penalties, biases,
masks and temperature: vLLM's default ``raw_logprobs``), taken from the logits a step
already has, batched over the rows that asked.

* Output tokens: every sampled row of a request with ``logprobs`` set gives the sampled
  token's logprob, its rank (1 + how many tokens are more likely; ties count against it,
  as vLLM counts them) and the ``logprobs`` most likely tokens, most likely first: one
  :data:`kvbm.protocol.Logprob` per token.
* Prompt tokens: a request with ``prompt_logprobs`` set computes its whole prompt (the
  scheduler finds none of it in the prefix cache: :attr:`workers.scheduler.Seq.whole_prompt`)
  and the step asks the model for the logits of every prompt position it computes
  (:func:`prompt_rows`): position ``p`` predicts prompt token ``p + 1``. They are gathered
  across prefill chunks (by position, so a preempted prompt recomputed fills the same
  entries) and go out with the request's first token; the first prompt token's is
  ``None``. A request that continues another's stream (a P/D decode, a migrated stream)
  has its first token already and computes none.

Values below :data:`LOGPROB_FLOOR` are clamped to it (OpenAI's stand-in for -inf: JSON has
no infinity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbm.protocol import LOGPROB_FLOOR
from workers.logits import state_of
from workers.scheduler import Seq


def prompt_rows(batch: Sequence[tuple[Seq, int, int]]) -> list[tuple[int, Seq, int]]:
    """``(row, seq, position)`` of every prompt position in the step whose logits give a
    prompt logprob: ``row`` is its index in the step's flattened tokens."""
    out: list[tuple[int, Seq, int]] = []
    row = 0
    for seq, start, end in batch:
        if seq.whole_prompt:
            last = min(end, seq.num_prompt - 1)
            out.extend((row + p - start, seq, p) for p in range(start, last))
        row += end - start
    return out


def record_prompt(logits: torch.Tensor, rows: list[tuple[int, Seq, int]], vocab: int) -> None:
    """Store the prompt logprobs of ``rows`` (``logits``: their logits, in that order) in
    each request's state, by position."""
    targets = [seq.token_ids[p + 1] for _, seq, p in rows]
    ks = [seq.req.params.prompt_logprobs or 0 for _, seq, _ in rows]
    lps = token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, ks)
    for (_, seq, p), lp in zip(rows, lps, strict=True):
        st = state_of(seq, vocab)
        if st.prompt_logprobs is None:
            st.prompt_logprobs = [None] * seq.num_prompt
        st.prompt_logprobs[p + 1] = lp


def take_prompt(seq: Seq, vocab: int) -> list | None:
    """The prompt logprobs owed with ``seq``'s first token (``None`` when it asked for
    none, or they went out already)."""
    if not seq.whole_prompt:
        return None
    st = state_of(seq, vocab)
    out = st.prompt_logprobs or [None] * seq.num_prompt  # a one-token prompt has none
    st.prompt_logprobs = None
    return out


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[list]:
    """Per row of ``logprobs`` ([R, V] log-softmax): ``[logprob of tokens[r], its rank,
    [[id, logprob] of the ks[r] most likely, most likely first]]``. One copy to Python for
    the numbers, one for the ids (a step's cost: docs/performance.md, "Logprobs: cost at c=16")."""
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True).to(logprobs.dtype)
    k = min(max(ks, default=0), logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k else None
    cols = [chosen, ranks] if top is None else [chosen, ranks, top.values]
    nums = torch.cat(cols, dim=1).clamp_min(LOGPROB_FLOOR).tolist()
    ids = top.indices.tolist() if top is not None else [[]] * len(tokens)
    rows = zip(nums, ids, ks, strict=True)
    return [[row[0], int(row[1]), list(map(list, zip(tid[:kr], row[2 : 2 + kr], strict=True)))]
            for row, tid, kr in rows]  # fmt: skip
