"""Logits processing: what a request's sampling parameters do to its row of a step's logits
before the sampler draws from it, batched over the rows that need each stage.

vLLM's order, after the raw logprobs were taken from the untouched logits
(:mod:`workers.logprobs`) and after any structured-output mask:

1. masks and biases: ``allowed_token_ids`` (every other token -inf), ``logit_bias``
   (added), ``bad_words`` (a banned sequence's last token is -inf once the output so far
   ends with its other tokens; a one-token word always is) and ``min_tokens`` (the stop
   and end-of-sequence tokens are -inf until that many tokens are out);
2. penalties: ``repetition_penalty`` over the prompt's and the output's tokens (Hugging
   Face's: a positive logit is divided by it, a negative one multiplied), then
   ``frequency_penalty`` (subtracted once per occurrence in the output) and
   ``presence_penalty`` (subtracted once if the token occurs in the output), OpenAI's;
3. the thinking budget (:mod:`workers.thinking`): a row whose budget is spent keeps only
   the end-of-thinking token it must give (every other token -inf);

then the sampler (:func:`workers.sampling.sample`): temperature, min-p, top-k, top-p, or
the argmax of these logits for greedy requests.

A request keeps a :class:`SeqState` on its sequence: a [V] row that adds its allowed ids
and biases (fixed for its life) and, with penalties, its output token counts and the tokens
of its prompt, brought up to date with the tokens sampled since the last step. A step
stacks the rows of the requests that need a stage and applies it in a few tensor ops; a
request that uses none of it costs one attribute check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbm.protocol import Sampling
from workers.scheduler import Seq
from workers.thinking import ThinkingState

NEG_INF = float("-inf")


class SeqState:
    """What the engine keeps per request between steps for its logits: the processors'
    state, and the prompt logprobs gathered chunk by chunk until its first token."""

    __slots__ = ("static", "bad_single", "bad_multi", "penalized", "counts", "prompt_seen",
                 "n_counted", "processes", "prompt_logprobs", "thinking")  # fmt: skip

    def __init__(self, params: Sampling, prompt: Sequence[int], vocab: int) -> None:
        # allowed ids and biases: one row added to the logits, the same at every step
        self.static: torch.Tensor | None = None
        if params.allowed_token_ids is not None or params.logit_bias:
            row = torch.zeros(vocab)
            if params.allowed_token_ids is not None:
                row.fill_(NEG_INF)
                row[_in_vocab(params.allowed_token_ids, vocab)] = 0.0
            bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab}
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long)
                row.index_add_(0, ids, torch.tensor(list(bias.values())))
            self.static = row
        words = [w for w in params.bad_words if w and all(0 <= t < vocab for t in w)]
        self.bad_single = [w[0] for w in words if len(w) == 1]
        self.bad_multi = [w for w in words if len(w) > 1]
        # penalties: output token counts, and the prompt's tokens (repetition penalty)
        self.penalized = params.penalized
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        if self.penalized:
            self.counts = torch.zeros(vocab)
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool)
            if params.repetition_penalty != 1.0:
                self.prompt_seen[_in_vocab(prompt, vocab)] = True
        self.n_counted = 0  # output tokens already in counts
        self.thinking = None if params.thinking is None else ThinkingState(params.thinking, prompt)
        # whether anything here changes the logits
        self.processes = bool(self.static is not None or self.penalized or words
                              or self.thinking is not None)  # fmt: skip
        self.prompt_logprobs: list | None = None  # per prompt position (workers.logprobs)

    def count(self, output_ids: list[int]) -> None:
        """Bring the output counts up to ``output_ids`` (the tokens sampled since)."""
        new = output_ids[self.n_counted :]
        if new and self.counts is not None:
            self.counts.index_add_(0, torch.tensor(new, dtype=torch.long),
                                   torch.ones(len(new)))  # fmt: skip
        self.n_counted = len(output_ids)

    def banned_words(self, output_ids: list[int]) -> list[int]:
        """The bad words' tokens banned now: each word's last token, once the output ends
        with its others (one-token words always)."""
        out = list(self.bad_single)
        n = len(output_ids)
        for w in self.bad_multi:
            k = len(w) - 1
            if n >= k and output_ids[n - k :] == w[:k]:
                out.append(w[-1])
        return out


def state_of(seq: Seq, vocab: int) -> SeqState:
    """``seq``'s state, made on first use."""
    st = seq.sampling
    if st is None:
        st = seq.sampling = SeqState(seq.req.params, seq.token_ids[: seq.num_prompt], vocab)
    return st  # type: ignore[return-value]


def process(logits: torch.Tensor, seqs: Sequence[Seq], banned: Sequence[list[int]]) -> torch.Tensor:
    """Apply every request's processors to its row of ``logits`` ([len(seqs), V], rows in
    ``seqs`` order), in place; ``banned``: per row, the ids min_tokens holds back now.
    Returns ``logits``."""
    vocab = logits.shape[-1]
    static_rows: list[int] = []
    statics: list[torch.Tensor] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    pen_rows: list[int] = []
    pens: list[tuple[SeqState, Sampling]] = []
    forced_rows: list[int] = []
    forced_ids: list[int] = []
    for i, seq in enumerate(seqs):
        if banned[i]:
            ban_rows += [i] * len(banned[i])
            ban_ids += banned[i]
        st = state_of(seq, vocab)
        if not st.processes:
            continue
        if st.static is not None:
            static_rows.append(i)
            statics.append(st.static)
        if st.bad_single or st.bad_multi:
            words = st.banned_words(seq.output_ids)
            ban_rows += [i] * len(words)
            ban_ids += words
        if st.penalized:
            st.count(seq.output_ids)
            pen_rows.append(i)
            pens.append((st, seq.req.params))
        if st.thinking is not None and (tok := st.thinking.forced(seq.output_ids)) is not None:
            forced_rows.append(i)
            forced_ids.append(tok)
    if static_rows:
        rows = torch.tensor(static_rows, dtype=torch.long)
        logits.index_add_(0, rows, torch.stack(statics).to(logits.dtype))
    if ban_rows:
        logits[torch.tensor(ban_rows, dtype=torch.long),
               torch.tensor(ban_ids, dtype=torch.long)] = NEG_INF  # fmt: skip
    if pen_rows:
        _penalize(logits, pen_rows, pens)
    if forced_rows:
        rows = torch.tensor(forced_rows, dtype=torch.long)
        logits[rows] = NEG_INF
        logits[rows, torch.tensor(forced_ids, dtype=torch.long)] = 0.0
    return logits


# --------------------------------------------------------------------------------------
def _penalize(logits: torch.Tensor, rows: list[int],
              pens: list[tuple[SeqState, Sampling]]) -> None:  # fmt: skip
    idx = torch.tensor(rows, dtype=torch.long)
    counts = torch.stack([st.counts for st, _ in pens])  # type: ignore[misc]
    in_output = counts > 0
    seen = torch.stack([st.prompt_seen for st, _ in pens]) | in_output  # type: ignore[misc]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for _, p in pens], dtype=logits.dtype)[:, None]

    sub = logits[idx]
    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= column("frequency_penalty") * counts + column("presence_penalty") * in_output
    logits[idx] = sub


def _in_vocab(ids: Sequence[int], vocab: int) -> torch.Tensor:
    return torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long)
