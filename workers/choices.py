"""A request of ``n`` choices in the engine process: ``n`` engine requests, one stage task.

The engine process gets one command for the request (its stage task's payload, ``n`` in
its sampling) and runs it as ``n`` engine requests, each on its choice's own stream
(:func:`kvbm.protocol.choice_stream_id`) with its own seed
(:func:`kvbm.protocol.choice_seed`). The later choices name the first as the one they fork
from (``EngineRequest.fork_of``): the engine computes the prompt once and starts them on
its blocks and its logits (:mod:`workers.scheduler`). Prompt logprobs, when asked for, are
computed by the first choice alone (the API puts them on every choice). From there each
choice is an ordinary request: it streams, finishes and is aborted on its own id (and
moves to another worker alone if this one dies, :meth:`api.runner.Runner._migrate`).

:class:`ChoiceGroups` remembers which choices make up which request: an abort of the
request reaches every choice still running, and the request's stage task hears that it
ended (one completion, the prompt counted once, the choices' output tokens summed) when
its last choice has.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbm.protocol import choice_seed, choice_stream_id

if TYPE_CHECKING:
    from workers.engine_api import EngineRequest
    from workers.engine_ipc import Completion


class ChoiceGroups:
    """The requests of ``n > 1`` choices running in this engine process (thread-safe: the
    command reader expands and aborts, the engine loop's publisher collects)."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._request_of: dict[str, str] = {}  # choice stream id -> its request's id
        self._lock = threading.Lock()

    def expand(self, req: EngineRequest) -> list[EngineRequest]:
        """The engine requests that run ``req``: itself when ``n`` is 1, else one per
        choice (choice 0 with the request's seed, the others forking from it)."""
        n = req.params.n
        if n == 1:
            return [req]
        assert req.imported is None and req.resumed is None and not req.prefill_only, \
            "a request of n > 1 choices runs aggregated, from its prompt"  # fmt: skip
        ids = [choice_stream_id(req.request_id, i) for i in range(n)]
        out = []
        for i, cid in enumerate(ids):
            update: dict[str, object] = {"seed": choice_seed(req.params.seed, i)}
            if i:
                update["prompt_logprobs"] = None  # the first choice's serve them all
            params = req.params.model_copy(update=update)
            out.append(dataclasses.replace(req, request_id=cid, params=params,
                                           fork_of=ids[0] if i else None))  # fmt: skip
        with self._lock:
            self._groups[req.request_id] = _Group(req.request_id, set(ids))
            self._request_of.update(dict.fromkeys(ids, req.request_id))
        return out

    def targets(self, request_id: str) -> list[str]:
        """What an abort of ``request_id`` reaches: the choices still running when it is a
        request of choices, else itself (one choice, or a request of one)."""
        with self._lock:
            g = self._groups.get(request_id)
            return sorted(g.left) if g is not None else [request_id]

    def collect(self, done: list[Completion]) -> list[Completion]:
        """``done`` as the stage tasks hear it: a choice's completion counts into its
        request's, which is reported once the request's last choice has ended; others
        pass through."""
        out: list[Completion] = []
        with self._lock:
            for c in done:
                rid = self._request_of.pop(c.request_id, None)
                if rid is None:
                    out.append(c)
                    continue
                g = self._groups[rid]
                g.left.discard(c.request_id)
                g.ended.append(c)
                if not g.left:
                    del self._groups[rid]
                    out.append(g.completion())
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)


@dataclass(slots=True)
class _Group:
    request_id: str
    left: set[str]  # its choices still running
    ended: list[Completion] = field(default_factory=list)  # the others', as they ended

    def completion(self) -> Completion:
        """The request's completion: the first choice's, with every choice's output."""
        first = min(self.ended, key=lambda c: c.request_id)
        error = next((c.error for c in self.ended if c.error), None)
        return dataclasses.replace(first, request_id=self.request_id, error=error,
                                   completion_tokens=sum(c.completion_tokens
                                                         for c in self.ended))  # fmt: skip
