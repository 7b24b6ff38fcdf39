"""The engine in its own process, driven from the Celery worker process over a pipe.

Celery's consumer (receive, QoS bookkeeping, acks, task events) and the task threads are
Python code that would otherwise share one GIL with the engine loop; on a small machine
that costs the engine a fifth of its steps. So, as vLLM's V1 does with its EngineCore, the
engine runs in a child process that owns the model, the KV pool and the frame publisher;
the Celery process only forwards commands and waits for completions.

    Celery process (EngineClient)            engine process (_serve)
      submit(rid, prompt, params)  ─pipe─>     EngineLoop.submit
      abort(rid)                   ─pipe─>     EngineLoop.abort
      waiter woken             <─pipe─  done   FramePublisher -> Redis  tokens:{rid}
      stats() (for heartbeats) <─pipe─  stats  every stats_period_s

If the engine process dies, the client marks itself dead and fails every waiter; the worker
then exits so its heartbeat stops and the API moves the requests elsewhere.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineProcSpec:
    """Everything the engine process needs; plain data, picklable."""

    model_dir: str
    engine_config: dict
    redis_url: str
    torch_threads: int = 1
    stats_period_s: float = 0.25
    log_level: int = logging.INFO


@dataclass(slots=True)
class Completion:
    """How a request ended, as the engine process reports it."""

    request_id: str
    finish_reason: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None


class EngineDied(RuntimeError):
    pass


class EngineClient:
    """The Celery-side handle on the engine process (thread-safe)."""

    def __init__(self, spec: EngineProcSpec, on_death: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self._on_death = on_death
        self._ctx = mp.get_context("spawn")
        self._conn: Connection | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._send_lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._stats: dict = {}
        self._dead = False
        self._stopping = False
        self._reader: threading.Thread | None = None

    # ----------------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> EngineClient:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_serve, args=(self.spec, child), name="conveyor-engine", daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(timeout):
            self._proc.kill()
            raise EngineDied(f"engine process did not start within {timeout:.0f}s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            raise EngineDied("engine process exited while starting (see its log)") from None
        if kind != "ready":
            raise EngineDied(f"engine process failed to start: {payload}")
        self._stats = payload
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        log.info("engine process %d ready", self._proc.pid)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc is None:
            return
        try:
            self._send(("stop", None))
        except (EngineDied, OSError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stats(self) -> dict:
        return dict(self._stats)

    def submit(self, request_id: str, prompt_ids: list[int], params: dict) -> _Waiter:
        waiter = _Waiter()
        with self._lock:
            if self._dead:
                raise EngineDied("engine process is gone")
            self._waiters[request_id] = waiter
        self._send(("submit", (request_id, prompt_ids, params)))
        return waiter

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._waiters

    def pending(self) -> int:
        with self._lock:
            return len(self._waiters)

    # ----------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        assert self._conn is not None, "EngineClient used before start()"
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, ValueError) as e:
                raise EngineDied(f"engine process unreachable: {e}") from e

    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "done":
                for c in payload:
                    with self._lock:
                        waiter = self._waiters.pop(c.request_id, None)
                    if waiter is not None:
                        waiter.result = c
                        waiter.event.set()
            elif kind == "stats":
                self._stats = payload
        self._died()

    def _died(self) -> None:
        with self._lock:
            self._dead = True
            waiters, self._waiters = self._waiters, {}
        for rid, w in waiters.items():
            w.result = Completion(rid, "error", error="engine process died")
            w.event.set()
        if not self._stopping:
            log.critical("engine process exited unexpectedly")
            if self._on_death is not None:
                self._on_death()


# --------------------------------------------------------------------------------------
# The engine process
# --------------------------------------------------------------------------------------


def _serve(spec: EngineProcSpec, conn: Connection) -> None:
    """Entry point of the engine process."""
    logging.basicConfig(
        level=spec.log_level,
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s",
    )
    import redis
    import torch

    from workers.engine import Engine, EngineConfig, EngineLoop, EngineRequest, RequestOutput
    from workers.sampling import SamplingParams
    from workers.stream import FramePublisher

    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    try:
        torch.set_num_threads(spec.torch_threads)
        engine = Engine.from_model_dir(Path(spec.model_dir), EngineConfig(**spec.engine_config))
        client = redis.Redis.from_url(spec.redis_url)
        client.ping()
    except Exception as e:  # noqa: BLE001 - report the reason to the parent
        log.exception("engine process failed to start")
        send(("error", f"{type(e).__name__}: {e}"))
        return

    def on_published(outs: list[RequestOutput]) -> None:
        done = [
            Completion(
                o.request_id, o.finish_reason, o.num_prompt_tokens, o.num_output_tokens, o.error
            )  # fmt: skip
            for o in outs
            if o.finished
        ]
        if done:
            send(("done", done))

    publisher = FramePublisher(client, on_published)
    loop = EngineLoop(engine, publisher.publish_outputs).start()
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(spec.stats_period_s):
            try:
                send(("stats", loop.stats()))
            except OSError:
                return

    threading.Thread(target=report, name="stats", daemon=True).start()
    send(("ready", loop.stats()))
    log.info("engine process %d serving %s", os.getpid(), spec.model_dir)
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break  # the worker process is gone: nothing left to serve
        if kind == "submit":
            rid, prompt_ids, params = payload
            try:
                sp = SamplingParams.from_dict(params)
            except (TypeError, ValueError) as e:
                publisher.publish_error(rid, f"invalid sampling parameters: {e}",
                                        code="invalid_sampling_params")  # fmt: skip
                continue
            loop.submit(EngineRequest(rid, list(prompt_ids), sp))
        elif kind == "abort":
            loop.abort(payload)
        elif kind == "stop":
            break
    stop.set()
    t0 = time.monotonic()
    loop.stop()
    publisher.stop()
    log.info("engine process stopped in %.2fs", time.monotonic() - t0)
