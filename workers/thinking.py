"""A request's thinking budget (vLLM's ``thinking_token_budget``): where its output stands
against it, and the token the engine forces next, if any.

A reasoning model thinks between a start marker (``<think>``) and an end marker
(``</think>``); the markers come as token ids (:class:`kvbm.protocol.ThinkingBudget`, from
the API's reasoning parser or ``CONVEYOR_REASONING_CONFIG``). A block opens where the text
holds the start marker and closes where it holds the natural end marker; the prompt counts
too, so a chat template that opens ``<think>`` in the prompt starts the output inside a
block, with the tokens after the marker already counted; where the API's reasoning parser
reads the output as starting inside one (``inside``), it does whatever the prompt holds.
Once a block holds ``budget`` tokens, the engine forces the end sequence one token a step
(:func:`workers.logits.process`: every other token is ``-inf``), and the output goes on as
an answer. Each block has its own count, as in vLLM.

Torch-free and incremental: :meth:`ThinkingState.forced` reads only the tokens sampled
since it last looked.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbm.protocol import ThinkingBudget


def _last_index(ids: Sequence[int], marker: list[int]) -> int:
    """Where ``marker`` last starts in ``ids``; -1 if nowhere. (Once per request, over
    its prompt: the marker's first token is looked for by list.index, in C.)"""
    k, n = len(marker), len(ids)
    backwards = list(ids)[::-1]
    j = 0
    while True:
        try:
            j = backwards.index(marker[0], j)
        except ValueError:
            return -1
        i = n - 1 - j
        if i + k <= n and list(ids[i : i + k]) == marker:
            return i
        j += 1


class ThinkingState:
    """One sequence's place against its budget."""

    __slots__ = ("spec", "inside", "count", "forcing", "seen", "window", "tail")

    def __init__(self, spec: ThinkingBudget, prompt: Sequence[int]) -> None:
        self.spec = spec
        start = _last_index(prompt, spec.start)
        inside = start >= 0 and start > _last_index(prompt, spec.natural_end)
        self.count = len(prompt) - start - len(spec.start) if inside else 0  # its tokens
        self.inside = inside or spec.inside  # in a thinking block now
        self.forcing = -1  # the index in ``end`` forced next; -1: not forcing
        self.seen = 0  # output tokens read
        # the last few tokens (the prompt's, then the output's): markers span tokens
        self.window = max(len(spec.start), len(spec.natural_end), len(spec.end)) - 1
        self.tail = list(prompt[-self.window :]) if self.window else []

    def forced(self, output_ids: Sequence[int]) -> int | None:
        """The token the next step must give, given the output so far; None: any."""
        for tok in output_ids[self.seen :]:
            self._read(tok)
        self.seen = len(output_ids)
        if self.forcing < 0 and self.inside and self.count >= self.spec.budget:
            # the model may be part of the way through the end sequence: go on from there
            self.forcing = self._partial(self.spec.end)
        return self.spec.end[self.forcing] if self.forcing >= 0 else None

    def _read(self, tok: int) -> None:
        spec = self.spec
        self.tail.append(tok)
        if self.forcing >= 0:  # the forced token came out: on with the end sequence
            self.forcing += 1
            if self.forcing == len(spec.end):  # the block is closed
                self.forcing, self.inside, self.count = -1, False, 0
        elif self.inside:
            if self._ends_with(spec.natural_end):
                self.inside, self.count = False, 0
            else:
                self.count += 1
        elif self._ends_with(spec.start):
            self.inside, self.count = True, 0
        if len(self.tail) > self.window + 1:
            del self.tail[0]

    def _partial(self, marker: list[int]) -> int:
        """How many of ``marker``'s first tokens the output ends with (fewer than all)."""
        out = self.tail[-self.seen :] if self.seen else []
        for k in range(min(len(marker) - 1, len(out)), 0, -1):
            if out[-k:] == marker[:k]:
                return k
        return 0

    def _ends_with(self, marker: list[int]) -> bool:
        k = len(marker)
        return len(self.tail) >= k and self.tail[-k:] == marker
