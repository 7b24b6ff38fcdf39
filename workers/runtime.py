"""One worker process's runtime: engine loop, token publishing, cancel listener, heartbeat.

Celery task threads call :meth:`WorkerRuntime.generate`, which submits the request into the
shared engine loop and blocks that task thread until the request has finished (so a late
ack covers the whole generation). The engine loop publishes every step's frames; the
runtime wakes the waiting task thread when a request's terminal frame is out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from workers.engine import Engine, EngineConfig, EngineLoop, EngineRequest, RequestOutput
from workers.registry import Heartbeat
from workers.sampling import SamplingParams
from workers.stream import CANCEL_CHANNEL, CANCELLED_KEY, FramePublisher

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: RequestOutput | None = None


class WorkerRuntime:
    def __init__(
        self,
        *,
        model_dir: str | Path,
        pool: str,
        worker_id: str,
        redis_url: str,
        engine_config: EngineConfig,
        torch_threads: int = 1,
        heartbeat_s: float = 2.0,
        worker_ttl_s: float = 10.0,
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.pool = pool
        self.worker_id = worker_id
        self.redis = redis.Redis.from_url(redis_url)
        self.engine = Engine.from_model_dir(model_dir, engine_config)
        self.publisher = FramePublisher(self.redis, self._on_published)
        self.loop = EngineLoop(self.engine, self.publisher.publish_outputs)
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self.heartbeat = Heartbeat(
            self.redis, pool, worker_id, self.load_report, heartbeat_s, worker_ttl_s
        )
        self._cancel_pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._cancel_thread = threading.Thread(
            target=self._listen_cancels, name="cancel-listener", daemon=True
        )
        self._stopping = threading.Event()

    # ----------------------------------------------------------------------------------
    def start(self) -> WorkerRuntime:
        self.loop.start()
        self._cancel_pubsub.subscribe(CANCEL_CHANNEL)
        self._cancel_thread.start()
        self.heartbeat.start()
        log.info("worker %s (pool %s) ready", self.worker_id, self.pool)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.heartbeat.stop()
        try:
            self._cancel_pubsub.unsubscribe()
            self._cancel_pubsub.close()
        except redis.RedisError:
            pass
        self.loop.stop()
        self.publisher.stop()

    def load_report(self) -> dict:
        stats = self.loop.stats()
        with self._lock:
            inflight = len(self._waiters)
        return {**stats, "active": stats["running"] + stats["waiting"], "inflight": inflight}

    def generate(self, request_id: str, prompt_token_ids: list[int], params: dict) -> dict:
        """Run one request to completion; frames are published as it goes.

        Returns a small summary (finish reason and token counts) — the task's handle."""
        try:
            sp = SamplingParams.from_dict(params)
        except (TypeError, ValueError) as e:
            self.publisher.publish_error(request_id, str(e), code="invalid_sampling_params")
            return {"request_id": request_id, "finish_reason": "error"}
        waiter = _Waiter()
        with self._lock:
            self._waiters[request_id] = waiter
        t0 = time.perf_counter()
        self.loop.submit(EngineRequest(request_id, list(prompt_token_ids), sp))
        # The API sets the cancelled key before it publishes a cancel, so checking it after
        # submitting closes the window where a cancel reached us before the request did.
        if self.redis.exists(CANCELLED_KEY.format(request_id)):
            log.info("[%s] cancelled before it started", request_id)
            self.loop.abort(request_id)
        waiter.event.wait()
        out = waiter.result
        assert out is not None, "waiter woken without a result"
        log.info(
            "[%s] %s: %d prompt + %d output tokens in %.3fs",
            request_id,
            out.finish_reason,
            out.num_prompt_tokens,
            out.num_output_tokens,
            time.perf_counter() - t0,
        )
        return {
            "request_id": request_id,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_output_tokens,
        }

    # ----------------------------------------------------------------------------------
    def _on_published(self, outs: list[RequestOutput]) -> None:
        """Frames are out: wake the task threads whose requests just finished."""
        for out in outs:
            if not out.finished:
                continue
            with self._lock:
                waiter = self._waiters.pop(out.request_id, None)
            if waiter is not None:
                waiter.result = out
                waiter.event.set()

    def _listen_cancels(self) -> None:
        while not self._stopping.is_set():
            try:
                for msg in self._cancel_pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    rid = msg["data"].decode() if isinstance(msg["data"], bytes) else msg["data"]
                    with self._lock:
                        mine = rid in self._waiters
                    if mine:
                        log.info("[%s] cancel received", rid)
                        self.loop.abort(rid)
            except (redis.RedisError, ValueError, AttributeError) as e:
                if self._stopping.is_set():
                    return
                log.warning("cancel listener reconnecting after: %s", e)
                time.sleep(0.5)
                try:
                    self._cancel_pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    self._cancel_pubsub.subscribe(CANCEL_CHANNEL)
                except redis.RedisError:
                    pass


_runtime: WorkerRuntime | None = None


def set_runtime(rt: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = rt


def get_runtime() -> WorkerRuntime:
    assert _runtime is not None, "no WorkerRuntime in this process: start it with conveyor worker"
    return _runtime
