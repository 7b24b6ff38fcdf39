"""What crosses the pipe between a worker process and its engine (or encoder) process.

Every message is one of the types below, pickled whole; nothing on the pipe is a
positional tuple. Commands go to the engine process: a stage's run (one type per kind, built
from the stage task's arguments by :func:`tasks.stages.stage_command`), an abort, a stop.
Replies come back: ready (or why it failed to start), requests done, stats for the
heartbeat. The engine process turns a run into its engine's request in one place
(:func:`workers.engine_proc.engine_request`).

    worker process                          engine process
      Generate | Prefill | Decode |  ─pipe─>  _EngineServer.handle / EncodeServer.handle
      Encode | Embed | Abort | Stop
      Ready | StartFailed          <─pipe─   once, at start
      Done | Stats                 <─pipe─   as requests end; every stats period

Both processes import this module and nothing of each other's, so neither the engine process
nor the encoder process imports the other (``workers.engine_proc`` starts either).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from cluster.stats import EngineStats
from kvbm.protocol import EmbeddingRef, EncodeHandle, PrefillHandle, StagePayload

if TYPE_CHECKING:
    from workers.engine_api import EngineTiming

# --------------------------------------------------------------------------------------
# Commands: worker process -> engine process
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    """A stage's request for the engine process: the stage payload as its task received it."""

    kind: ClassVar[str]  # what logs call it
    choices: ClassVar[bool] = False  # whether a request of n > 1 choices may come as one
    payload: StagePayload

    def __post_init__(self) -> None:
        assert self.choices or self.payload.sampling.n == 1, \
            "a request of n > 1 choices runs aggregated (tasks.pipeline plans it so)"  # fmt: skip

    @property
    def request_id(self) -> str:
        return self.payload.request_id


@dataclass(slots=True)
class Generate(_Run):
    """Aggregated: prefill and decode here (``refs``: embeddings an encode worker made)."""

    kind: ClassVar[str] = "generate"
    choices: ClassVar[bool] = True
    refs: list[EmbeddingRef] = field(default_factory=list)


@dataclass(slots=True)
class Prefill(_Run):
    """Prefill only: the first token, then the prompt's KV pinned for a decode worker."""

    kind: ClassVar[str] = "prefill"
    refs: list[EmbeddingRef] = field(default_factory=list)


@dataclass(slots=True)
class Decode(_Run):
    """Decode after a prefill worker's first token: ``handle`` says where its KV is."""

    kind: ClassVar[str] = "decode"
    handle: PrefillHandle


@dataclass(slots=True)
class Encode(_Run):
    """The request's images through the vision tower (an encode worker's process)."""

    kind: ClassVar[str] = "encode"
    choices: ClassVar[bool] = True


@dataclass(slots=True)
class Embed(_Run):
    """An embedding request: the prompt's pooled hidden states (``payload.pooling``)."""

    kind: ClassVar[str] = "embed"


Run = Generate | Prefill | Decode | Encode | Embed


@dataclass(slots=True)
class Abort:
    """Drop a request (or a choice's stream of one) wherever it is."""

    request_id: str


@dataclass(slots=True)
class Stop:
    """Finish up and exit."""


Command = Run | Abort | Stop

# --------------------------------------------------------------------------------------
# Replies: engine process -> worker process
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Completion:
    """How a request ended, as the engine process reports it."""

    request_id: str
    finish_reason: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    handle: PrefillHandle | EncodeHandle | None = None  # what the next stage pulls from
    transfer_failed: bool = False  # decode: the KV could not be pulled
    engine_died: bool = False  # the engine process is gone; the request is lost with it
    cached_tokens: int = 0  # prompt tokens its prefix cache served
    timing: EngineTiming | None = None  # how it went through the engine (its trace)


@dataclass(slots=True)
class Ready:
    """The engine process is serving; its first stats."""

    stats: EngineStats


@dataclass(slots=True)
class StartFailed:
    """The engine process could not start, and why."""

    reason: str


@dataclass(slots=True)
class Done:
    """Requests that ended."""

    completions: list[Completion]


@dataclass(slots=True)
class Stats:
    """The engine process's counters, for the worker's heartbeat."""

    stats: EngineStats


Reply = Ready | StartFailed | Done | Stats
