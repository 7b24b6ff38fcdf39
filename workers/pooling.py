"""Embeddings in the engine process: how a model pools, and the runner that computes each
embedding request between the engine's steps. torch-free (the mock engine's process
imports it); the arithmetic is :mod:`workers.pooler`'s.

Public part:
    PoolingConfig        how the served model pools: last token, mean or first token, and
                         whether it L2-normalises; :func:`load_pooling_config` reads it
    PoolingEngine        an engine that computes embeddings (has a ``pooler``); others
                         refuse them with a 400
    SelfPoolingEngine    an engine that runs embedding requests in its own scheduling
                         (vLLM started with its pooling runner)
    PoolingUnavailable   an engine's pooler cannot serve (its checkpoint's config says a
                         pooling it does not do)
    EmbeddingRunner      runs the engine process's embedding requests

How vLLM decides, and so do we: a decoder-only LM served for embeddings pools the last
token's hidden state and normalises it, unless its checkpoint has a sentence-transformers
layout: ``modules.json`` naming a ``Pooling`` module, whose ``config.json`` (e.g.
``1_Pooling/config.json``) sets one of ``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``; the vector is then normalised
only if ``modules.json`` also lists a ``Normalize`` module. A pooling mode we do not
compute (max, weighted mean, ...) is not guessed at: embeddings are refused, naming it.

Scheduling: an embedding request never enters the scheduler and holds no KV blocks. Its
prompt runs through the model in chunks of at most :data:`CHUNK_TOKENS` tokens (or the
engine's ``max_num_batched_tokens``, if smaller), each chunk on the engine loop's thread
between two engine steps (:meth:`workers.engine_loop.EngineLoop.call`: the model is not
thread-safe), so a long input (or a batch of them) delays each decode step by at most one
chunk's forward. Requests run one at a time, in arrival order. Like vLLM's pooling
runner, it neither reads nor fills the prefix cache: nothing is generated after the
prompt, so its KV would never be reused by the request itself.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvbm.protocol import Pooling
from workers.engine_api import RequestOutput, aborted, failed

if TYPE_CHECKING:
    from workers.engine_loop import EngineLoop

log = logging.getLogger(__name__)

POOLING_TYPES = ("last", "mean", "cls")
# Prompt tokens per chunk of an embedding (capped by the engine's step budget): on CPU a
# 256-token chunk goes through a long input as fast as any (2048-token chunks are the
# slowest: attention over the whole window at once) and stalls the streams decoding beside
# it a tenth as long (docs/performance.md, "Embeddings: chunks between engine steps")
CHUNK_TOKENS = 256
# sentence-transformers' Pooling config keys -> ours (others: not computed here)
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # its newer "pooling_mode"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How the served model pools its hidden states for an embedding."""

    type: str = "last"  # last | mean | cls (first token)
    normalize: bool = True  # L2-normalise the pooled vector (a request may override)
    source: str = "default"  # where it was read (for the log)
    unsupported: str | None = None  # why embeddings are refused (a mode we do not compute)

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, "
                             f"not {self.type!r}")  # fmt: skip


def load_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The model directory's pooling: its sentence-transformers layout's, else the default
    of a decoder-only LM (last token, normalised)."""
    d = Path(model_dir)
    modules_file = d / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == ST_POOLING),
                   None)  # fmt: skip
    if pooling is None:  # no Pooling module: the default pooler, as vLLM does
        return PoolingConfig()
    where = Path(pooling.get("path") or "") / "config.json"
    normalize = ST_NORMALIZE in types
    raw = json.loads((d / where).read_text())
    if isinstance(raw.get("pooling_mode"), str):
        modes = [raw["pooling_mode"]]
        found = [_ST_NAMES.get(m) for m in modes]
    else:
        modes = [k for k, v in raw.items() if k.startswith("pooling_mode_") and v is True]
        found = [_ST_MODES.get(m) for m in modes]
    source = f"{modules_file.name} + {where}"
    why = None
    if len(modes) != 1 or found[0] is None:
        why = (f"{where} asks for pooling {', '.join(modes) or 'none'}; this engine pools "
               f"by exactly one of {', '.join(_ST_MODES)}")  # fmt: skip
    elif raw.get("include_prompt", True) is False:
        why = f"{where} sets include_prompt false (an instruction-less mean); not supported"
    if why is not None:
        log.warning("embeddings will be refused: %s", why)
        return PoolingConfig(normalize=normalize, source=source, unsupported=why)
    return PoolingConfig(found[0], normalize, source)  # type: ignore[arg-type]


class PoolingUnavailable(Exception):
    """The engine's pooler cannot serve this model's pooling (the message says why)."""


class Pooler(Protocol):
    def start(self, token_ids: list[int], params: Pooling) -> EmbeddingJob:
        """A job for one prompt (any thread: it allocates, it runs nothing)."""


class EmbeddingJob(Protocol):
    """One prompt's embedding, computed a chunk at a time (``step``: on the engine loop's
    thread only, the model is not thread-safe)."""

    @property
    def done(self) -> bool: ...

    def step(self, max_tokens: int) -> None:
        """Run the next chunk of at most ``max_tokens`` prompt tokens."""

    def result(self) -> bytes:
        """The vector as little-endian float32 bytes (once ``done``)."""


@runtime_checkable
class PoolingEngine(Protocol):
    """An engine that computes embeddings (the reference engine)."""

    def pooler(self) -> Pooler:
        """Its pooler; raises :class:`PoolingUnavailable` when it cannot serve the model."""


@runtime_checkable
class SelfPoolingEngine(Protocol):
    """An engine that runs an embedding request itself, in its own scheduling (vLLM with
    its pooling runner): no chunks here, one blocking call per request."""

    def embed_prompt(self, request_id: str, token_ids: list[int],
                     params: Pooling) -> RequestOutput:  # fmt: skip
        """The request's one terminal output: its vector, or the error."""


def refusal(request_id: str, num_tokens: int, engine_name: str, why: str = "") -> RequestOutput:
    """The failed output of an embedding request this engine does not serve: a 400."""
    return failed(request_id, num_tokens,
                  why or f"the {engine_name} engine does not serve embeddings "
                         "(/v1/embeddings); run the reference engine",
                  "unsupported_parameter")  # fmt: skip


class EmbeddingRunner:
    """Runs the engine process's embedding requests (see the module's docstring): one at a
    time on a thread of its own, each chunk on the engine loop's thread; the result (or
    the error) goes out through ``publish`` as the request's one, terminal frame."""

    def __init__(
        self, engine: object, loop: EngineLoop,
        publish: Callable[[list[RequestOutput]], None], chunk_tokens: int,
    ) -> None:  # fmt: skip
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine = engine
        self.loop = loop
        self.publish = publish
        self.chunk_tokens = chunk_tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="embed")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._aborted: set[str] = set()
        self._pooler: Pooler | None = None  # the engine's, once asked for
        self.chunks = 0  # forward calls made (stats)

    def submit(self, request_id: str, token_ids: list[int], params: Pooling) -> None:
        with self._lock:
            self._pending.add(request_id)
        self._pool.submit(self._run, request_id, token_ids, params)

    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` before its next chunk; False if it is not one of ours."""
        with self._lock:
            if request_id not in self._pending:
                return False
            self._aborted.add(request_id)
            return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------------------
    def _run(self, rid: str, token_ids: list[int], params: Pooling) -> None:
        try:
            out = self._embed(rid, token_ids, params)
        except PoolingUnavailable as e:
            out = refusal(rid, len(token_ids), "", str(e))
        except Exception as e:  # noqa: BLE001 - the stream must still end with a frame
            log.exception("[%s] embedding failed", rid)
            out = failed(rid, len(token_ids), f"embedding failed: {e}")
        finally:
            with self._lock:
                self._pending.discard(rid)
                self._aborted.discard(rid)
        self.publish([out])

    def _embed(self, rid: str, token_ids: list[int], params: Pooling) -> RequestOutput:
        n = len(token_ids)
        if isinstance(self.engine, SelfPoolingEngine):  # it pools in its own steps (vLLM)
            return self.engine.embed_prompt(rid, token_ids, params)
        if not isinstance(self.engine, PoolingEngine):
            return refusal(rid, n, getattr(self.engine, "name", "this"))
        if self._pooler is None:  # built from the engine's fields: it runs nothing
            self._pooler = self.engine.pooler()
        job = self._pooler.start(token_ids, params)  # its KV cache: allocated off the loop
        while not job.done:
            if rid in self._aborted:
                return aborted(rid, n)
            # one chunk per call: the loop steps the engine between two calls
            self.loop.call(lambda _e: job.step(self.chunk_tokens)).result()
            self.chunks += 1
        vector = base64.b64encode(job.result()).decode()
        return RequestOutput(rid, [], "", finished=True, finish_reason="stop",
                             num_prompt_tokens=n, embedding=vector)  # fmt: skip
