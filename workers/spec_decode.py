"""Speculative decoding by n-gram lookup (vLLM's ``{"method": "ngram"}``, "prompt lookup
decoding"): draft tokens for a decoding sequence are read from its own context, where the
last few tokens appeared before, and one forward pass checks them all.

A step that speculates for a sequence computes its last token and the ``k`` drafts behind
it as one chunk, with logits at every one of those ``k + 1`` rows. Row ``i`` predicts the
token after draft ``i - 1``; the drafts are accepted up to the first one the model would
not have picked, and the model's own token at that row follows them (or, all accepted, the
token after the last draft). Only the KV of the last token and of the accepted drafts is
kept; the rejected drafts' slots are written again by the next step.

A greedy request (temperature 0) gets exactly the output it gets without speculation,
token for token. A sampled one's drafts go through rejection sampling
(:func:`workers.sampling.speculative_picks`): a draft is accepted with its probability
under the model (the sampler's distribution: temperature, top-k, top-p, min-p), else the
token is drawn from that distribution without it, so its tokens are distributed as one at
a time (the same distribution, not the same draws as without speculation: a seeded
request still reproduces itself). Requests whose logits anything else shapes or records
(penalties, biases, allowed or banned tokens, ``min_tokens``, a grammar, logprobs, a forced
first token) decode one token a step beside them.

**Predicted outputs** (OpenAI's ``prediction``: text the output is expected to mostly
repeat, as when a file is rewritten with a few edits) give drafts too, on any engine that
speculates and whether or not n-gram speculation is configured: a
:class:`PredictionTracker` follows where the output is in the prediction and drafts the
prediction's next tokens; after an edit it finds its place again from the output's last
few tokens. A sequence with a prediction drafts from it first, then from its own context.
What was drafted from the prediction and accepted or rejected is the request's
``accepted_prediction_tokens`` / ``rejected_prediction_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.scheduler import Seq

SPEC_METHODS = ("ngram",)
# draft tokens per step from a predicted output where no speculative config sets them
PREDICTION_DRAFT_TOKENS = 8


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """vLLM's ``--speculative-config`` for the n-gram method."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def parse(cls, raw: dict | None) -> SpecConfig | None:
        """From vLLM's JSON object; ``None``: no speculation. ValueError names a bad key."""
        if not raw:
            return None
        method = raw.get("method", "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative method {method!r} is not served by this engine "
                             f"(only {', '.join(SPEC_METHODS)}; --engine vllm serves the "
                             "others)")  # fmt: skip
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        if extra := sorted(set(raw) - known):
            raise ValueError(f"unknown speculative_config keys {extra} (known: {sorted(known)})")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be 1 to 16")
        hi = raw.get("prompt_lookup_max", 4)
        lo = raw.get("prompt_lookup_min", min(2, hi) if isinstance(hi, int) else 2)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max <= 16")  # fmt: skip
        return cls(k, hi, lo)


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams (``lo`` to ``hi`` tokens) by where they last ended, indexed
    as the sequence grows: a lookup costs a dict probe per n, not a scan of the context."""

    lo: int
    hi: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the context's
        last ``n`` tokens (``hi`` down to ``lo``); ``[]`` when none occurred before."""
        last = len(tokens) - 1
        for end in range(self.upto, last):  # every n-gram ending before the last token
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                self.ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.upto = max(self.upto, last)
        for n in range(min(self.hi, last + 1), self.lo - 1, -1):
            at = self.ends.get(tuple(tokens[last - n + 1 :]))
            if at is not None:
                return tokens[at + 1 : at + 1 + k]
        return []


@dataclass(slots=True)
class PredictionTracker:
    """Where a sequence's output stands in its predicted output (``ids``): the next
    output token is expected at ``ids[pos]`` (``None``: lost after an edit). Lost, it is
    found again after the longest of the output's last ``SYNC`` tokens (two at least)
    that occurs in the prediction, at the occurrence nearest after where it was last;
    failing that, after the output's last token where it occurs just ahead (a deletion);
    failing that, where a substitution of as many tokens would have left it (the place it
    was lost, one on per token since)."""

    SYNC = 3

    ids: list[int]
    pos: int | None = 0
    seen: int = 0  # output tokens followed so far
    last: int = 0  # the last place it was found
    guess: int = 0  # lost: where a same-length substitution would have left it
    accepted: int = 0  # draft tokens from the prediction the model accepted
    rejected: int = 0
    _where: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in range(1, self.SYNC + 1):  # each n-gram's end positions, in order
            for end in range(n, len(self.ids) + 1):
                self._where.setdefault(tuple(self.ids[end - n : end]), []).append(end)

    def propose(self, output: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction after the output's place in it."""
        for tok in output[self.seen :]:
            if self.pos is not None and self.pos < len(self.ids) and self.ids[self.pos] == tok:
                self.pos += 1
            else:
                self.guess = (self.pos if self.pos is not None else self.guess) + 1
                self.pos = None
        self.seen = len(output)
        if self.pos is None and output:
            self.pos = self._find(output)
            if self.pos is None:  # the last token just ahead (a deletion), else a substitution
                near = self._where.get((output[-1],), [])
                self.pos = next((e for e in near if self.last <= e <= self.guess + self.SYNC),
                                self.guess if self.guess < len(self.ids) else None)  # fmt: skip
        if self.pos is None:
            return []
        self.last = self.pos
        return self.ids[self.pos : self.pos + k]

    def _find(self, output: list[int]) -> int | None:
        for n in range(min(self.SYNC, len(output)), 1, -1):
            ends = self._where.get(tuple(output[-n:]))
            if ends:
                return next((e for e in ends if e >= self.last), ends[-1])
        return None


def eligible(seq: Seq) -> bool:
    """Whether ``seq``'s drafts can be checked against its logits as they stand: nothing
    but the sampler's own parameters (temperature, top-k, top-p, min-p) shapes them, and
    nothing records them."""
    p = seq.req.params
    return (not p.processed and p.logprobs is None and p.prompt_logprobs is None
            and seq.constraint is None and len(seq.output_ids) >= p.min_tokens
            and seq.req.forced_first_token is None and not seq.forks)  # fmt: skip


def accepted(drafts: list[int], picks: list[int]) -> list[int]:
    """The tokens a step that checked ``drafts`` gives: the drafts the model agrees with
    (``picks[i]``: its token after draft ``i - 1``), then its own next token."""
    out = []
    for d, p in zip(drafts, picks, strict=False):
        if d != p:
            break
        out.append(d)
    out.append(picks[len(out)])
    return out


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec-decode counters: drafts proposed, draft tokens, tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
