"""One worker process's runtime: engine process client, cancel listener, heartbeat.

Celery task threads call :meth:`WorkerRuntime.generate`, which submits the request to the
engine process (:mod:`workers.engine_proc`) and blocks that task thread until the request
has finished (so a late ack covers the whole generation). The engine process publishes
every step's frames itself; the runtime only learns when a request is done.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import redis

from cluster.membership import Heartbeat, HeartbeatReport, declare_dead
from cluster.tracing import Tracing
from kvbm.protocol import (
    CANCEL_CHANNEL,
    EncodeHandle,
    PrefillHandle,
    StageSummary,
    cancelled_key,
    choice_request_id,
)
from workers.engine_api import EngineConfig
from workers.engine_ipc import Completion, Decode, Embed, Encode, Generate, Prefill, Run
from workers.engine_proc import EngineClient, EngineDied, EngineProcSpec, _Waiter
from workers.stream import publish_error_frame

log = logging.getLogger(__name__)


class KVPullFailed(RuntimeError):
    """The decode worker could not pull a request's prefilled KV."""


class WorkerRuntime:
    def __init__(
        self,
        *,
        model_dir: str | Path,
        pool: str,
        worker_id: str,
        redis_url: str,
        engine_config: EngineConfig,
        # the settings (tasks.settings, built into these by `conveyor worker`): no defaults
        torch_threads: int,
        heartbeat_s: float,
        worker_ttl_s: float,
        engine_hang_timeout_s: float,
        kv_transfer: str | None,  # None: this pool moves no KV
        kv_transfer_threads: int,
        transfer_timeout_s: float,
        engine_cpus: tuple[int, ...] | None,
        engine: str,
        mock_timing: dict,
        vllm_args: tuple[str, ...],
        fastpath: bool,
        role: str,
        embedding_transfer: str,
        encoder_cache_mb: int,
        encoder_max_batch: int,
        log_requests: bool,
        frame_log_ttl_s: float,
        tracing: Tracing | None = None,  # cluster.tracing: a span per stage task
        log_format: str = "text",  # the engine process's (cluster.logs)
    ) -> None:
        self.pool = pool
        self.tracing = tracing
        # a line per finished request at INFO only when asked (CONVEYOR_LOG_REQUESTS)
        self._request_log = logging.INFO if log_requests else logging.DEBUG
        self.worker_id = worker_id
        self.redis = redis.Redis.from_url(redis_url)
        spec = EngineProcSpec(
            model_dir=str(model_dir),
            engine_config=asdict(engine_config),
            redis_url=redis_url,
            worker_id=worker_id,
            pool=pool,
            engine=engine,
            mock=mock_timing,
            vllm_args=vllm_args,
            kv_transfer=kv_transfer,
            kv_transfer_threads=kv_transfer_threads,
            transfer_timeout_s=transfer_timeout_s,
            torch_threads=torch_threads,
            cpus=engine_cpus,
            stats_period_s=min(0.25, heartbeat_s / 2),
            hang_timeout_s=engine_hang_timeout_s,
            log_level=logging.getLogger().getEffectiveLevel(),
            log_format=log_format,
            fastpath=fastpath,
            role=role,
            embedding_transfer=embedding_transfer,
            encoder_cache_mb=encoder_cache_mb,
            encoder_max_batch=encoder_max_batch,
            frame_log_ttl_s=frame_log_ttl_s,
        )
        self.frame_log_ttl_s = frame_log_ttl_s
        self.engine = EngineClient(spec, on_death=self._engine_died)
        self.heartbeat = Heartbeat(
            self.redis, pool, worker_id, self.load_report, heartbeat_s, worker_ttl_s
        )
        self._cancel_pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._cancel_thread = threading.Thread(
            target=self._listen_cancels, name="cancel-listener", daemon=True
        )
        self._stopping = threading.Event()
        # requests the worker's event loop started as their message arrived (begin), by
        # id, until their stage task takes the waiter
        self._begun: dict[str, _Waiter] = {}
        self._begun_lock = threading.Lock()

    # ----------------------------------------------------------------------------------
    def start(self) -> WorkerRuntime:
        """Start the engine process and the cancel listener. The worker is not announced
        yet: call :meth:`announce` once its queues are being consumed."""
        self.engine.start()
        self._cancel_pubsub.subscribe(CANCEL_CHANNEL)
        self._cancel_thread.start()
        return self

    def announce(self) -> None:
        """Start heartbeating: from now on routers may send requests here."""
        self.heartbeat.start()
        log.info("worker %s (pool %s) ready", self.worker_id, self.pool)

    def leave(self) -> None:
        """Leave the pool (routers stop picking this worker); keep serving what it has."""
        self.heartbeat.stop()
        log.info("worker %s leaving pool %s; finishing the requests it holds",
                 self.worker_id, self.pool)  # fmt: skip

    def stop(self) -> None:
        self._stopping.set()
        self.heartbeat.stop()
        try:
            self._cancel_pubsub.unsubscribe()
            self._cancel_pubsub.close()
        except redis.RedisError:
            pass
        self.engine.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # the last spans out

    def load_report(self) -> HeartbeatReport:
        """The engine's side of this worker's heartbeat (the heartbeat stamps the rest)."""
        st = self.engine.stats()
        return HeartbeatReport(self.worker_id, self.pool, active=st.running + st.waiting,
                               inflight=self.engine.pending(), engine_pid=self.engine.pid,
                               stats=st)  # fmt: skip

    def generate(self, cmd: Generate | Embed) -> StageSummary:
        """Run one request to completion; frames are published as it goes (an embedding
        request's one frame, see :meth:`embed`)."""
        t0 = time.perf_counter()
        request_id = cmd.request_id
        # A request not begun on receipt (a redelivered task, among others) is skipped if
        # the API is done with it. The API sets the cancelled key before it publishes a
        # cancel, so checking it after submitting too (in _wait) closes the window where a
        # cancel beat the request here.
        begun = self._take_begun(request_id)
        if begun is None:
            if self._abandoned(request_id):
                return StageSummary(request_id=request_id, finish_reason="abort")
            waiter = self.engine.run(cmd)
        else:
            waiter = begun
        out = self._wait(request_id, waiter)
        self._span(cmd, waiter, out)
        log.log(
            self._request_log,
            "[%s] %s: %d prompt + %d output tokens in %.3fs%s",
            request_id,
            out.finish_reason,
            out.prompt_tokens,
            out.completion_tokens,
            time.perf_counter() - t0,
            " (begun on receipt)" if begun else "",
        )
        return _summary(request_id, out)

    def embed(self, cmd: Embed) -> StageSummary:
        """Embedding request: its prompt's pooled hidden states, sent as the stream's one
        frame (workers.pooling)."""
        return self.generate(cmd)

    def begin(self, cmd: Generate | Prefill | Embed) -> None:
        """Start a ``generate``, ``prefill`` or ``embed`` request in the engine now, ahead of
        its stage task, which then waits for this run (:meth:`generate`, :meth:`prefill`).

        Called on the worker's event loop as the task's message arrives
        (:func:`tasks.celery_ext.begin_on_receipt`): Celery hands a task to a pool thread
        only after building its request, sending its events and waking the thread, a slow
        hand-over on a worker whose Celery side runs niced on a busy core
        (docs/performance.md, "Celery: requests begin on receipt"). Every request begun must
        reach its task or :meth:`forget`."""
        with self._begun_lock:  # held while submitting: the task cannot miss the waiter
            if cmd.request_id not in self._begun:
                self._begun[cmd.request_id] = self.engine.run(cmd)

    def forget(self, request_id: str) -> None:
        """A request begun whose task will not run (revoked, or refused by Celery): abort
        it in the engine."""
        if self._take_begun(request_id) is not None:
            log.info("[%s] begun but its task will not run: aborting", request_id)
            self.engine.abort(request_id)

    def _take_begun(self, request_id: str) -> _Waiter | None:
        with self._begun_lock:
            return self._begun.pop(request_id, None)

    def fail(self, request_id: str, message: str, code: str, seq: int = 0) -> None:
        """End a stream with an error frame numbered ``seq`` (0: nothing was streamed;
        1: only the prefill worker's first token was)."""
        publish_error_frame(self.redis, request_id, message, code, seq, self.frame_log_ttl_s)

    def prefill(self, cmd: Prefill) -> PrefillHandle:
        """Prefill stage: run the prompt, stream the first token, pin the KV; returns the
        handle the decode stage pulls it with."""
        request_id = cmd.request_id
        waiter = self._take_begun(request_id)
        if waiter is None:  # not begun on receipt: skipped if abandoned, as in generate
            if self._abandoned(request_id):
                return PrefillHandle(request_id=request_id, prefill_worker=self.worker_id,
                                     finished=True, finish_reason="abort")  # fmt: skip
            waiter = self.engine.run(cmd)
        out = self._wait(request_id, waiter)
        self._span(cmd, waiter, out, kv_backend=getattr(out.handle, "backend", None))
        if out.handle is not None:
            assert isinstance(out.handle, PrefillHandle), "a prefill's result hands over its KV"
            log.info("[%s] prefilled %d tokens; KV exported via %s", request_id,
                     out.prompt_tokens, out.handle.backend)  # fmt: skip
            return out.handle
        # finished on its first token (or failed): the stream is complete already
        return PrefillHandle(request_id=request_id, prefill_worker=self.worker_id,
                             finished=True, finish_reason=out.finish_reason,
                             error=out.error)  # fmt: skip

    def decode(self, cmd: Decode) -> StageSummary:
        """Decode stage: pull the prefilled KV, then generate from the second token on.
        Raises :class:`KVPullFailed` when the KV could not be pulled (nothing streamed)."""
        t0 = time.perf_counter()
        request_id, handle = cmd.request_id, cmd.handle
        if self._abandoned(request_id):
            return StageSummary(request_id=request_id, finish_reason="abort")
        waiter = self.engine.run(cmd)
        out = self._wait(request_id, waiter)
        self._span(cmd, waiter, out, kv_backend=handle.backend,
                   prefill_worker=handle.prefill_worker)  # fmt: skip
        if out.transfer_failed:
            raise KVPullFailed(out.error or "KV pull failed")
        log.info("[%s] %s: decoded %d tokens after a %s pull in %.3fs", request_id,
                 out.finish_reason, out.completion_tokens, handle.backend,
                 time.perf_counter() - t0)  # fmt: skip
        return _summary(request_id, out)

    def encode(self, cmd: Encode) -> EncodeHandle:
        """Encode stage: the images through the vision tower; the handle says where their
        embeddings are (or that encoding failed: the stream has ended then)."""
        t0 = time.perf_counter()
        request_id = cmd.request_id
        if self._abandoned(request_id):
            return EncodeHandle(request_id=request_id, encode_worker=self.worker_id,
                                error="abandoned")  # fmt: skip
        waiter = self.engine.run(cmd)
        out = self._wait(request_id, waiter)
        self._span(cmd, waiter, out, images=len(cmd.payload.images))
        if not isinstance(out.handle, EncodeHandle):
            why = out.error or f"not encoded ({out.finish_reason})"
            return EncodeHandle(request_id=request_id, encode_worker=self.worker_id, error=why)
        log.info("[%s] %d image(s) encoded in %.3fs%s", request_id, len(cmd.payload.images),
                 time.perf_counter() - t0,
                 f": {out.handle.error}" if out.handle.error else "")  # fmt: skip
        return out.handle

    def _span(self, cmd: Run, waiter: _Waiter, out: Completion, **extra: object) -> None:
        """The stage task's span in its request's trace: from the request's start in the
        engine (its message's arrival, when begun on receipt) to its end here; none where
        the request is not traced."""
        if cmd.payload.trace is None or self.tracing is None:
            return
        p, t = cmd.payload, out.timing
        attrs: dict[str, object] = {
            "conveyor.request_id": cmd.request_id,
            "conveyor.worker.id": self.worker_id,
            "conveyor.pool": self.pool,
            "gen_ai.usage.input_tokens": out.prompt_tokens,
            "gen_ai.usage.output_tokens": out.completion_tokens,
            "conveyor.usage.cached_tokens": out.cached_tokens,
            "gen_ai.response.finish_reasons": [out.finish_reason] if out.finish_reason else None,
            "gen_ai.latency.time_in_queue": t.queued_s if t else None,
            "gen_ai.latency.time_to_first_token": t.first_token_s if t else None,
            "conveyor.preemptions": t.preemptions if t else None,
            "conveyor.prefill_redo": p.attempt or None,
            "conveyor.migration": p.resume.migration if p.resume else None,
        }  # fmt: skip
        attrs.update({f"conveyor.{k}": v for k, v in extra.items()})
        self.tracing.span(cmd.kind, p.trace, waiter.submitted_ns, time.time_ns(), attrs,
                          kind="CONSUMER", error=out.error)  # fmt: skip

    def _abandoned(self, request_id: str) -> bool:
        """Whether the API is done with the request (it ended, or was given up on): a task
        delivered again after that is skipped before the engine sees it."""
        if self.redis.exists(cancelled_key(request_id)):
            log.info("[%s] abandoned before it started: skipped", request_id)
            return True
        return False

    def _wait(self, request_id: str, waiter) -> Completion:
        if self.redis.exists(cancelled_key(request_id)):
            log.info("[%s] cancelled before it started", request_id)
            self.engine.abort(request_id)
        waiter.event.wait()
        out = waiter.result
        assert out is not None, "waiter woken without a result"
        if out.engine_died:
            raise EngineDied(f"[{request_id}] engine process died mid-request")
        return out

    def _engine_died(self) -> None:
        """Fail fast: stop heartbeating and declare this worker dead (routers stop sending
        here, every API moves its streams on at once, its own queue goes back to the
        pool's), then exit; the broker keeps unacked tasks."""
        if self._stopping.is_set():
            return
        log.critical("worker %s: engine process died; exiting", self.worker_id)
        try:
            self.heartbeat.halt()
            declare_dead(self.redis, self.pool, self.worker_id)
        except redis.RedisError as e:
            log.warning("worker %s: could not declare itself dead (%s)", self.worker_id, e)
        finally:
            os._exit(70)

    # ----------------------------------------------------------------------------------
    def _listen_cancels(self) -> None:
        while not self._stopping.is_set():
            try:
                for msg in self._cancel_pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    rid = msg["data"].decode() if isinstance(msg["data"], bytes) else msg["data"]
                    # a choice of a request of n > 1 is cancelled on its own stream's id
                    if self.engine.is_pending(rid) or self.engine.is_pending(
                        choice_request_id(rid) or rid
                    ):
                        log.info("[%s] cancel received", rid)
                        self.engine.abort(rid)
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


def _summary(request_id: str, out: Completion) -> StageSummary:
    return StageSummary(request_id=request_id, finish_reason=out.finish_reason,
                        prompt_tokens=out.prompt_tokens,
                        completion_tokens=out.completion_tokens, error=out.error)  # fmt: skip


_runtime: WorkerRuntime | None = None


def set_runtime(rt: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = rt


def get_runtime() -> WorkerRuntime:
    assert _runtime is not None, "no WorkerRuntime in this process: start it with conveyor worker"
    return _runtime


def lower_priority(nice: int) -> int:
    """Raise every thread of this process to niceness ``nice`` at least (Linux keeps it per
    thread; threads started later inherit their creator's), or, elsewhere, the process.
    Child processes already running keep theirs. Returns the threads changed."""
    if nice <= 0:
        return 0
    if not sys.platform.startswith("linux"):
        current = os.nice(0)
        if current < nice:
            os.nice(nice - current)
        return 1
    changed = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    return changed
