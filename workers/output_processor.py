"""Per-token post-processing: detokenization, stop rules, finish reasons, usage.

Given the token a step sampled for a sequence, decide whether the sequence goes on or
finishes (a stop string, a stop token id, end of sequence, ``max_tokens``, the context
window), and build the :class:`workers.engine_api.RequestOutput` the frame publisher turns
into a frame. ``min_tokens`` holds every stop back until that many tokens are out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.engine_api import EngineTiming, RequestOutput
from workers.scheduler import Seq


@dataclass(slots=True)
class Verdict:
    output: RequestOutput
    finished: bool


class OutputProcessor:
    def __init__(self, eos_token_ids: list[int] | tuple[int, ...], max_model_len: int) -> None:
        self.eos_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def banned(self, seq: Seq) -> list[int]:
        """Token ids the sampler must not pick for ``seq`` now (stops before min_tokens)."""
        p = seq.req.params
        if len(seq.output_ids) >= p.min_tokens or (seq.constraint is not None
                                                    and seq.constraint.active):  # fmt: skip
            return []  # (a grammar decides where a constrained output may end)
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))

    def append(self, seq: Seq, tok: int) -> Verdict:
        """Add one sampled token to ``seq``: its output, and whether it finished."""
        p = seq.req.params
        seq.token_ids.append(tok)
        seq.output_ids.append(tok)
        n_out = len(seq.output_ids)
        if not seq.first_token:
            seq.first_token = time.monotonic()
        ended = seq.constraint is not None and seq.constraint.accept(tok)  # its grammar's end
        step = seq.detok.step(tok, check_stop=n_out >= p.min_tokens)
        reason: str | None = None
        stop_reason: str | int | None = None
        if step.stop is not None:
            reason, stop_reason = "stop", step.stop
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = "stop", tok
        elif tok in self.eos_ids and not p.ignore_eos and n_out >= p.min_tokens:
            reason = "stop"
        elif ended:  # the grammar has ended (or a token broke it: an error)
            reason = "stop" if seq.constraint.error is None else "error"  # type: ignore[union-attr]
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            out = RequestOutput(
                seq.id, [tok], step.text, num_prompt_tokens=seq.num_prompt,
                num_output_tokens=n_out, num_cached_tokens=seq.num_cached,
            )  # fmt: skip
            return Verdict(out, False)
        tail = "" if step.stop is not None else seq.detok.finish()
        out = finished(seq, [tok], step.text + tail, reason, stop_reason)
        if reason == "error":
            out.error = seq.constraint.error  # type: ignore[union-attr]
        return Verdict(out, True)


def finished(
    seq: Seq, toks: list[int], text: str, reason: str, stop_reason: str | int | None = None
) -> RequestOutput:
    """The last output of ``seq``."""
    return RequestOutput(
        seq.id,
        toks,
        text,
        finished=True,
        finish_reason=reason,
        stop_reason=stop_reason,
        num_prompt_tokens=seq.num_prompt,
        num_output_tokens=len(seq.output_ids),
        num_cached_tokens=seq.num_cached,
        timing=timing_of(seq),
        prediction=(seq.prediction.accepted, seq.prediction.rejected)
        if seq.prediction is not None
        else None,
    )


def timing_of(seq: Seq) -> EngineTiming:
    """How ``seq`` went through the engine so far."""
    return EngineTiming(seq.scheduled - seq.arrival if seq.scheduled else None,
                        seq.first_token - seq.arrival if seq.first_token else None,
                        seq.num_preemptions)  # fmt: skip
