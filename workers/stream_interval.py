"""The stream interval (vLLM's ``--stream-interval``): a request's outputs held back until
``interval`` tokens are held, then sent as one frame.

Every per-frame cost (the engine process's encode and socket write, Redis's ``PUBLISH``,
the API's SSE write) divides by it where the engine outruns the pipeline. A stream's first
frame is never held (time to first token unchanged), nor is one that ends it (finished,
failed, aborted, or a prefill worker's handing over): that one carries whatever was held.
:class:`workers.stream.FramePublisher` asks :class:`IntervalBuffer` per output, under its
lock; ``interval`` 1 (the default, ``CONVEYOR_STREAM_INTERVAL``) never asks it.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep this module torch-free
    from workers.engine_api import RequestOutput


class IntervalBuffer:
    """Per request, the outputs held since its last frame (not thread-safe: the frame
    publisher holds its lock around every call)."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be an int >= 1, not {interval!r}")
        self.interval = interval
        self._held: dict[str, _Held] = {}

    def due(self, outputs: list[RequestOutput], opened: Container[str]) -> list[RequestOutput]:
        """The frames' outputs that go out now of one step's ``outputs`` (:meth:`take` of
        each; ``opened``: the streams that have had a frame)."""
        taken = (self.take(out, out.request_id in opened) for out in outputs)
        return [o for o in taken if o is not None]

    def take(self, out: RequestOutput, opened: bool) -> RequestOutput | None:
        """``out`` merged after what its request holds, if a frame goes out now; else
        ``None`` (held). ``opened``: its stream has had a frame, or continues one another
        worker began (:meth:`FramePublisher.start_at`); a first frame goes out at once."""
        held = self._held.get(out.request_id)
        ends = out.finished or out.prefilled
        if held is None:
            if ends or not opened or len(out.token_ids) >= self.interval:
                return out
            self._held[out.request_id] = _Held([out], len(out.token_ids))
            return None
        held.outputs.append(out)
        held.tokens += len(out.token_ids)
        if ends or held.tokens >= self.interval:
            del self._held[out.request_id]
            return merge(held.outputs)
        return None

    def flush(self) -> list[RequestOutput]:
        """Every request's held outputs, merged (none of them ending its stream), and
        forgotten: what goes out when the publisher stops."""
        outs = [merge(h.outputs) for h in self._held.values()]
        self._held.clear()
        return outs

    def __len__(self) -> int:
        return len(self._held)


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """One output for ``outs`` (one request's, in order): their token ids, text and
    logprobs concatenated, the first prompt logprobs, the rest (finish, usage) the last's."""
    if len(outs) == 1:
        return outs[0]
    token_ids = [t for o in outs for t in o.token_ids]
    logprobs: list | None = None
    if any(o.logprobs is not None for o in outs):  # one per token id, as a frame has them
        logprobs = []
        for o in outs:
            logprobs += o.logprobs if o.logprobs is not None else [None] * len(o.token_ids)
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None),
                           None)  # fmt: skip
    return replace(outs[-1], token_ids=token_ids, text="".join(o.text for o in outs),
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)  # fmt: skip


@dataclass(slots=True)
class _Held:
    outputs: list[RequestOutput] = field(default_factory=list)
    tokens: int = 0
