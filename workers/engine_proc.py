"""The engine in its own process, driven from the Celery worker process over a pipe.

Celery's consumer (receive, QoS bookkeeping, acks, task events) and the task threads are
Python code that would otherwise share one GIL with the engine loop, and take steps from it
(docs/performance.md, "Engine in its own process"). So, as vLLM's V1 does with its
EngineCore, the engine runs in a child process that owns the model, the KV pool and the
frame publisher; the Celery process only forwards commands and waits for completions.

    Celery process (EngineClient)            engine process (_serve)
      run(Generate | Prefill | ...) ─pipe─>    EngineLoop.submit(EngineRequest)
      abort(rid)             ─pipe─>  Abort    EngineLoop.abort
      waiter woken           <─pipe─  Done     FramePublisher -> Redis  tokens:{rid}
      stats() (heartbeats)   <─pipe─  Stats    every stats_period_s

What crosses the pipe is typed in :mod:`workers.engine_ipc`. An encode worker's engine
process runs :class:`workers.encode_server.EncodeServer` instead of an engine.

If the engine process dies, the client marks itself dead and fails every waiter; the worker
then exits so its heartbeat stops and the API moves the requests elsewhere.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from operator import methodcaller
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.keys import CONTROL_CHANNEL, PAUSED_KEY, control_reply_key
from cluster.logs import setup_logging
from cluster.stats import EngineStats
from kvbm.protocol import PrefillHandle, kv_release_channel
from workers.choices import ChoiceGroups
from workers.engine_ipc import (
    Abort,
    Command,
    Completion,
    Decode,
    Done,
    Embed,
    Generate,
    Prefill,
    Ready,
    Reply,
    Run,
    StartFailed,
    Stats,
    Stop,
)
from workers.start_errors import killed_while_starting, out_of_memory

if TYPE_CHECKING:
    import redis

    from kvbm.events import KVEventPublisher
    from workers.encode_server import EncodeServer
    from workers.engine_api import Engine, EngineRequest
    from workers.engine_loop import EngineLoop
    from workers.images import ImageEncoder
    from workers.pooling import EmbeddingRunner
    from workers.stream import FramePublisher
    from workers.transfer.embeddings import EmbeddingTransfer

log = logging.getLogger(__name__)
CONTROL_REPLY_TTL_S = 60  # a control command's answers stay this long for the API to read
PAUSE_SYNC_S = 5.0  # how often an engine process reads the deployment's pause (PAUSED_KEY)


@dataclass(frozen=True)
class EngineProcSpec:
    """Everything the engine process needs; plain data, picklable."""

    # built by WorkerRuntime from the settings (tasks.settings): no defaults restated here
    model_dir: str
    engine_config: dict
    redis_url: str
    worker_id: str
    pool: str  # the worker pool, for the KV-block index
    engine: str  # reference | mock | vllm
    mock: dict  # MockTiming fields (engine == "mock")
    vllm_args: tuple[str, ...]  # vLLM engine flags (engine == "vllm"), `vllm serve`'s
    kv_transfer: str | None  # None: this pool moves no KV; else auto | nixl | redis
    kv_transfer_threads: int  # NIXL: threads pulling one large transfer
    transfer_timeout_s: float
    torch_threads: int
    cpus: tuple[int, ...] | None  # pin the engine process to these CPUs
    stats_period_s: float
    # the watchdog (EngineClient): silent, or in one engine-loop round, this long is hung
    hang_timeout_s: float
    log_level: int
    log_format: str  # cluster.logs: text | json
    fastpath: bool  # frames on a raw connection (workers.stream); else redis-py's
    role: str  # engine: the text model; encoder: the vision tower alone (encode pool)
    embedding_transfer: str  # how image embeddings move between workers
    encoder_cache_mb: int  # the image embedding cache
    encoder_max_batch: int  # images per vision-tower forward on an encode worker
    frame_log_ttl_s: float  # > 0: frames also go into their stream's log (resumable)


@dataclass(slots=True)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    submitted_ns: int = field(default_factory=time.time_ns)  # wall clock (its trace span)


class EngineDied(RuntimeError):
    pass


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """'0,2-3' -> (0, 2, 3); ``None``/empty -> ``None``."""
    if not text:
        return None
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}; expected e.g. '1' or '0,2-3'")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(cpus)))


def hang(silent_s: float, loop_busy_s: float, limit_s: float) -> str | None:
    """Why an engine process is taken for hung, or ``None``: it has sent nothing (not even
    its stats) for ``silent_s``, or its engine loop has been ``loop_busy_s`` in one round
    (a step), either past ``limit_s``."""
    if silent_s > limit_s:
        return f"no word from it for {silent_s:.1f}s"
    if loop_busy_s > limit_s:
        return f"one engine step under way for {loop_busy_s:.1f}s"
    return None


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
        self._stats = EngineStats()
        self._dead = False
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._heard_at = time.monotonic()  # the engine process's latest reply

    # ----------------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> EngineClient:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_serve, args=(self.spec, child), name="conveyor-engine", daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            if not parent.poll(timeout):
                self._proc.kill()
                raise EngineDied(f"engine process did not start within {timeout:.0f}s")
            try:
                reply: Reply = parent.recv()
            except EOFError:
                self._proc.join(5)
                why = killed_while_starting(self.spec.engine, self._proc.exitcode)
                why = why or "engine process exited while starting (see its log)"
                raise EngineDied(why) from None
            if isinstance(reply, StartFailed):
                raise EngineDied(f"engine process failed to start: {reply.reason}")
            assert isinstance(reply, Ready), f"engine process started with {reply!r}"
        except EngineDied:
            self._proc.join(5)
            self._kill_engine_group()
            raise
        self._stats = reply.stats
        self._heard_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        if self.spec.hang_timeout_s > 0:
            threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()
        log.info("engine process %d ready", self._proc.pid)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc is None:
            return
        try:
            self._send(Stop())
        except (EngineDied, OSError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._kill_engine_group()

    def _kill_engine_group(self) -> None:
        """The vLLM engine process leads a process group with vLLM's own processes
        (workers.vllm_engine): if it is gone, they must not outlive it."""
        proc = self._proc
        if self.spec.engine == "vllm" and proc is not None and proc.pid and not proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stats(self) -> EngineStats:
        return self._stats

    def run(self, cmd: Run) -> _Waiter:
        """Start ``cmd`` in the engine process; its waiter is woken when the request ends
        (a prefill's result carries the handle for the decode side, an encode's where the
        embeddings are).

        A request already running here (the broker redelivered its task: acks are late,
        so a consumer that lost its connection puts its unacked tasks back) is not run
        twice: the new task waits for the run in progress, and both end together."""
        request_id = cmd.request_id
        waiter = _Waiter()
        with self._lock:
            if self._dead:
                raise EngineDied("engine process is gone")
            running = self._waiters.get(request_id)
            if running is None:
                self._waiters[request_id] = waiter
        if running is not None:
            log.warning("[%s] delivered again while it runs here (%s); waiting for that run",
                        request_id, cmd.kind)  # fmt: skip
            return running
        self._send(cmd)
        return waiter

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._waiters

    def pending(self) -> int:
        with self._lock:
            return len(self._waiters)

    # ----------------------------------------------------------------------------------
    def _send(self, msg: Command) -> None:
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
                reply: Reply = self._conn.recv()
            except (EOFError, OSError):
                break
            self._heard_at = time.monotonic()
            if isinstance(reply, Done):
                for c in reply.completions:
                    with self._lock:
                        waiter = self._waiters.pop(c.request_id, None)
                    if waiter is not None:
                        waiter.result = c
                        waiter.event.set()
            elif isinstance(reply, Stats):
                self._stats = reply.stats
        self._died()

    def _watch(self) -> None:
        """The watchdog: a hung engine process is killed, and its death takes the worker
        down as any engine death does (its requests move on; it is started again)."""
        period = min(1.0, self.spec.hang_timeout_s / 4)
        while not (self._dead or self._stopping):
            time.sleep(period)
            why = hang(time.monotonic() - self._heard_at, self._stats.loop_busy_s,
                       self.spec.hang_timeout_s)  # fmt: skip
            if why is not None and not (self._dead or self._stopping):
                log.critical("engine process %s is hung (%s): killing it", self.pid, why)
                if self._proc is not None:
                    self._proc.kill()
                return

    def _died(self) -> None:
        with self._lock:
            self._dead = True
            waiters, self._waiters = self._waiters, {}
        for rid, w in waiters.items():
            w.result = Completion(rid, "error", error="engine process died", engine_died=True)
            w.event.set()
        if self._proc is not None:
            self._proc.join(1.0)
            self._kill_engine_group()
        if not self._stopping:
            log.critical("engine process exited unexpectedly")
            if self._on_death is not None:
                self._on_death()


# --------------------------------------------------------------------------------------
# The engine process
# --------------------------------------------------------------------------------------


def _serve(spec: EngineProcSpec, conn: Connection) -> None:
    """Entry point of the engine process."""
    # Only the worker process stops this one: a Stop message, or its end closing the
    # pipe. Ctrl-C or a SIGTERM sent to the whole process group (a terminal, `docker stop`,
    # a supervisor's killpg) would otherwise kill the engine under its worker mid-step, and
    # the worker would report an engine crash while shutting down on purpose.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(spec.log_level, spec.log_format)
    import redis

    send_lock = threading.Lock()

    def send(msg: Reply) -> None:
        with send_lock:
            conn.send(msg)

    try:
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
            log.info("engine process pinned to CPUs %s", ",".join(map(str, spec.cpus)))
        if spec.role == "encoder":
            client = redis.Redis.from_url(spec.redis_url)
            server: _EngineServer | EncodeServer = _start_encoder(spec, client, send)
        else:
            engine = _make_engine(spec)
            client = redis.Redis.from_url(spec.redis_url)
            server = _start_engine(spec, engine, client, send)
    except Exception as e:  # noqa: BLE001 - report the reason to the parent
        why = out_of_memory(spec.engine, f"{type(e).__name__}: {e}")  # a known cause: one line
        if why is None:
            log.exception("engine process failed to start")
        send(StartFailed(why or f"{type(e).__name__}: {e}"))
        return
    send(Ready(server.stats()))
    while True:
        try:
            msg: Command = conn.recv()
        except (EOFError, OSError):
            # the worker process is gone (killed: it would have said "stop"). Say so in
            # Redis now, so its streams move on at once instead of after its heartbeat TTL.
            declare_worker_dead(client, spec)
            break
        if isinstance(msg, Stop):
            break
        server.handle(msg)
    t0 = time.monotonic()
    server.close()
    log.info("engine process stopped in %.2fs", time.monotonic() - t0)


def _start_engine(spec: EngineProcSpec, engine: Engine, client: redis.Redis,
                  send: Callable[[Reply], None]) -> _EngineServer:  # fmt: skip
    """The text engine's server: the engine loop, its frame and KV-event publishers, the
    KV transfer backend and the image side, all started."""
    from kvbm.events import KVEventPublisher
    from workers.engine_loop import EngineLoop
    from workers.stream import FramePublisher, StockFramePublisher

    client.ping()
    images = emb_transfer = None
    if spec.engine != "mock" and _is_multimodal(spec.model_dir):
        images, emb_transfer = _image_side(spec, client)
    transfer = None
    if spec.kv_transfer and spec.engine != "vllm":  # vLLM moves KV with its connector
        from workers.llama import PagedKVCache  # torch: not for the mock engine
        from workers.transfer import make_transfer

        memory = engine.kv_memory()
        if not isinstance(memory, PagedKVCache):
            raise RuntimeError(f"the {spec.engine} engine keeps no KV to transfer")
        transfer = make_transfer(spec.kv_transfer, memory, client, spec.worker_id,
                                 spec.kv_transfer_threads)  # fmt: skip
    server = _EngineServer(spec, engine, client, transfer, send, images, emb_transfer)
    publisher = (FramePublisher if spec.fastpath else StockFramePublisher)(
        client, server.on_published, spec.frame_log_ttl_s,
        spec.engine_config["stream_interval"],
    )  # fmt: skip
    events = None
    if engine.records_kv_events:
        # on the frames' connection, from the engine loop's thread: no thread of its own
        events = KVEventPublisher(publisher, spec.pool, spec.worker_id,
                                  engine.cached_blocks_by_tier).start()  # fmt: skip
        # what the engine holds from the start (a disk tier's blocks from a previous run)
        events.publish(engine.take_kv_events(), idle=True)
    loop = EngineLoop(engine, publisher.publish_outputs,
                      event_sink=events.publish if events else None).start()  # fmt: skip
    server.attach(loop, publisher, events)
    log.info("engine process %d serving %s (kv transfer: %s)", os.getpid(), spec.model_dir,
             transfer.name if transfer else "none")  # fmt: skip
    return server


def _start_encoder(spec: EngineProcSpec, client: redis.Redis,
                   send: Callable[[Reply], None]) -> EncodeServer:  # fmt: skip
    """An encode worker's server: the vision tower alone, no text model."""
    import torch

    from workers.encode_server import EncodeServer

    torch.set_num_threads(spec.torch_threads)
    client.ping()
    encoder, transfer = _image_side(spec, client)
    server = EncodeServer(client, send, encoder, transfer, spec.worker_id,
                          spec.encoder_max_batch, spec.stats_period_s,
                          spec.frame_log_ttl_s)  # fmt: skip
    log.info("encoder process %d serving %s (embeddings via %s)", os.getpid(), spec.model_dir,
             transfer.name)  # fmt: skip
    return server


def _image_side(
    spec: EngineProcSpec, client: redis.Redis
) -> tuple[ImageEncoder, EmbeddingTransfer]:
    """The vision tower (with its embedding cache) and the embeddings' transfer backend."""
    from workers.images import ImageEncoder
    from workers.transfer.embeddings import make_embedding_transfer

    cfg = spec.engine_config
    encoder = ImageEncoder(spec.model_dir, client, spec.encoder_cache_mb,
                           cfg.get("dtype", "float32"), cfg.get("device", "cpu"))  # fmt: skip
    transfer = make_embedding_transfer(spec.embedding_transfer, client, spec.worker_id,
                                       hold_s=cfg.get("kv_pin_timeout_s", 60.0))  # fmt: skip
    return encoder, transfer


def declare_worker_dead(client: redis.Redis, spec: EngineProcSpec) -> None:
    """The engine (or encoder) process's last word when its worker process died under it."""
    import redis

    from cluster.membership import declare_dead

    try:
        declare_dead(client, spec.pool, spec.worker_id)
        log.warning("worker %s died under its engine process: declared dead", spec.worker_id)
    except redis.RedisError as e:
        log.warning("worker %s died; could not say so in Redis (%s)", spec.worker_id, e)


def engine_request(cmd: Generate | Prefill | Decode, **extra: object) -> EngineRequest:
    """The engine's request for ``cmd``, made here only (``extra``: what this process
    added: the images' embeddings, an imported prefill's KV source, ...)."""
    from workers.engine_api import EngineRequest, ResumedOutput

    p = cmd.payload
    resumed = None
    if p.resume is not None:  # a migrated stream: what the client already has
        resumed = ResumedOutput(list(p.resume.output_token_ids), p.resume.emitted_chars)
    return EngineRequest(p.request_id, p.prompt_token_ids, p.sampling,
                         prefill_only=isinstance(cmd, Prefill),
                         forced_first_token=p.forced_first_token, resumed=resumed,
                         priority=p.priority, lora=p.lora,
                         **extra)  # type: ignore[arg-type]  # fmt: skip


def _is_multimodal(model_dir: str) -> bool:
    """Whether the checkpoint has a vision tower (its config names one)."""
    import json

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return "vision_config" in raw


def _make_engine(spec: EngineProcSpec) -> Engine:
    from workers.engine_api import EngineConfig

    config = EngineConfig(**spec.engine_config)
    if spec.engine == "mock":
        from workers.mock_engine import MockEngine, MockTiming

        return MockEngine.from_model_dir(Path(spec.model_dir), config, MockTiming(**spec.mock))
    import torch

    from workers.engine import Engine

    torch.set_num_threads(spec.torch_threads)
    if spec.engine == "vllm":
        from workers.vllm_engine import VllmEngine

        # a prefill or decode pool hands KV over through vLLM's own connector
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(spec.pool)
        return VllmEngine(spec.model_dir, config, spec.vllm_args, tag=spec.worker_id,
                          kv_role=role if spec.kv_transfer else None)  # fmt: skip
    return Engine.from_model_dir(Path(spec.model_dir), config)


class _KVPull:
    """A disaggregated decode's :class:`workers.engine_api.KVSource`: the prefill worker's
    KV, pulled through the transfer backend into the blocks the engine allocated."""

    def __init__(self, server: _EngineServer, rid: str, handle: PrefillHandle) -> None:
        self.server = server
        self.rid = rid
        self.handle = handle
        self.deadline = time.monotonic() + server.spec.transfer_timeout_s

    def load(self, block_ids: list[int]) -> None:
        from workers.transfer import TransferError

        srv, h = self.server, self.handle
        if srv.transfer is None:
            raise TransferError("this worker has no KV transfer backend")
        try:
            srv.transfer.pull(h.transfer or {}, block_ids, srv.spec.transfer_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure: the decode task retries
            raise TransferError(f"KV pull from {h.prefill_worker} failed: {e}") from e
        srv.redis.publish(kv_release_channel(h.prefill_worker), self.rid)
        srv.publisher.start_at(self.rid, 1)  # the prefill worker streamed frame 0

    def failed(self, why: str) -> None:
        self.server._transfer_failed(self.rid, why)


class _EngineServer:
    """The engine process's command handlers (runs in the engine process only)."""

    def __init__(self, spec: EngineProcSpec, engine, client, transfer, send, images=None,
                 emb_transfer=None) -> None:  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        self.spec = spec
        self.engine = engine
        self.redis = client
        self.transfer = transfer
        self.send = send
        self.images = images  # workers.images.ImageEncoder: a vision-language model's
        self.emb_transfer = emb_transfer
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer")
        # images are made ready (pulled or encoded) off the loop, one request at a time
        # per thread, so a burst of image requests never holds up the KV pulls
        self.mm_pool = ThreadPoolExecutor(2, thread_name_prefix="images")
        self.exports: dict[str, dict] = {}  # prefill side: request -> transfer metadata
        # prefill side: a request's images and the embeddings it used, until its handle
        # carries them to the decode worker
        self.mm_used: dict[str, tuple[list, list]] = {}
        self.choices = ChoiceGroups()  # requests of n > 1 choices: n engine requests each
        self._stop = threading.Event()
        self._pause_wanted = False  # the control thread's: what it last asked of the loop
        # set by attach(), before the server is handed out (the publisher the loop feeds
        # needs on_published first)
        self.loop: EngineLoop
        self.publisher: FramePublisher
        self.events: KVEventPublisher | None = None
        self.embeddings: EmbeddingRunner

    def attach(self, loop, publisher, events) -> None:
        from workers.pooling import CHUNK_TOKENS, EmbeddingRunner

        self.loop = loop
        self.publisher = publisher
        self.events = events
        budget = self.spec.engine_config.get("max_num_batched_tokens", CHUNK_TOKENS)
        self.embeddings = EmbeddingRunner(self.engine, loop, publisher.publish_outputs,
                                          min(CHUNK_TOKENS, budget))  # fmt: skip
        threading.Thread(target=self._report, name="stats", daemon=True).start()
        threading.Thread(target=self._listen_control, name="control", daemon=True).start()
        if self.transfer is not None:
            threading.Thread(target=self._listen_releases, name="kv-release", daemon=True).start()

    def stats(self) -> EngineStats:
        st = self.loop.stats() if self.loop is not None else EngineStats()
        extra = getattr(self.engine, "extra_stats", None)  # vLLM: its own counts
        if extra is not None:
            extra(st)
        if self.publisher is not None:
            st.frames_published = self.publisher.frames_published
            st.frame_publish_errors = self.publisher.publish_errors
        if self.transfer is not None:
            st.kv_transfer = self.transfer.stats()
        if self.events is not None:
            ev = self.events
            st.kv_event_batches, st.kv_events = ev.batches_sent, ev.events_sent
            st.kv_event_resyncs, st.kv_event_errors = ev.resyncs, ev.errors
        if self.images is not None:
            st.images = self.images.counters()
        if self.emb_transfer is not None:
            st.embedding_transfer = self.emb_transfer.stats()
        return st

    # ----------------------------------------------------------------------------------
    def handle(self, cmd: Run | Abort) -> None:
        if isinstance(cmd, Abort):
            if self.embeddings.abort(cmd.request_id):  # an embedding's, else the engine's
                return
            for rid in self.choices.targets(cmd.request_id):  # a request of choices: all
                self.loop.abort(rid)
            return
        p = cmd.payload
        if isinstance(cmd, Embed):
            assert p.pooling is not None, "an embed command carries its pooling parameters"
            self.embeddings.submit(p.request_id, p.prompt_token_ids, p.pooling)
            return
        assert isinstance(cmd, Generate | Prefill | Decode), f"not for a text engine: {cmd!r}"
        if p.resume is not None:  # the stream carries on where the lost worker left it
            self.publisher.start_at(p.request_id, p.resume.next_seq)
        if p.images and self.images is not None:
            self.mm_pool.submit(self._with_images, cmd)
        elif isinstance(cmd, Decode) and self.spec.engine == "vllm":
            self._vllm_decode(cmd)
        elif isinstance(cmd, Decode):
            self.pool.submit(self._pull_and_decode, cmd)
        else:
            self._submit(engine_request(cmd))

    def _submit(self, req: EngineRequest) -> None:
        """Into the engine: ``req``, or each of its choices (n > 1)."""
        for r in self.choices.expand(req):
            self.loop.submit(r)

    def _with_images(self, cmd: Generate | Prefill | Decode) -> None:
        """Get the request's image embeddings (pulled or encoded here), then run it."""
        from kvbm.protocol import request_extra_keys
        from workers.images import ImageUnavailable, prepare

        p, rid = cmd.payload, cmd.request_id
        # an encode worker's embeddings, or those the prefill worker used
        refs = cmd.handle.embeddings if isinstance(cmd, Decode) else cmd.refs
        try:
            inputs = prepare(p.images, refs, self.images, self.emb_transfer,
                             self.spec.transfer_timeout_s)  # fmt: skip
        except ImageUnavailable as e:
            log.warning("[%s] %s", rid, e)
            if isinstance(cmd, Decode):
                self.publisher.start_at(rid, 1)  # the prefill worker streamed frame 0
            for sid in p.stream_ids:  # a request of choices listens on each choice's
                self.publisher.publish_error(sid, str(e), code="image_unavailable")
            if p.sampling.n > 1:  # its stage task waits for the request, not the choices
                self.send(Done([Completion(rid, "error", error=str(e))]))
            return
        extra = request_extra_keys(p.images, len(p.prompt_token_ids),
                                   self.engine.config.block_size)  # fmt: skip
        if isinstance(cmd, Decode):
            self._pull_and_decode(cmd, inputs, extra)
            return
        if isinstance(cmd, Prefill):
            self.mm_used[rid] = (p.images, [m.embeds for m in inputs])
        self._submit(engine_request(cmd, mm_inputs=inputs, block_extra_keys=extra))

    def on_published(self, outs) -> None:
        """Frames are out: report finished requests; export prefilled ones' KV."""
        done = [
            Completion(
                o.request_id,
                o.finish_reason,
                o.num_prompt_tokens,
                o.num_output_tokens,
                o.error,
                cached_tokens=o.num_cached_tokens,
                timing=o.timing,
            )  # fmt: skip
            for o in outs
            if o.finished
        ]
        if done and len(self.choices):  # a choice's end counts into its request's
            done = self.choices.collect(done)
        if done:
            self.send(Done(done))
        for o in outs:
            if o.prefilled:
                self.pool.submit(self._export, o)
            elif o.finished:
                self.mm_used.pop(o.request_id, None)

    # ----------------------------------------------------------------------------------
    def _export(self, out) -> None:
        rid = out.request_id
        try:
            if out.kv_transfer_params is not None:  # vLLM's connector holds the KV
                meta = out.kv_transfer_params
            else:
                meta = self.transfer.export(rid, out.kv_block_ids)
        except Exception as e:  # noqa: BLE001
            log.exception("[%s] KV export failed", rid)
            self.loop.call(lambda e_: e_.release_pinned(rid))
            self.send(Done([Completion(rid, "error", out.num_prompt_tokens, 1,
                                       f"KV export failed: {e}")]))  # fmt: skip
            return
        self.exports[rid] = meta
        embeddings = []
        used = self.mm_used.pop(rid, None)
        if used is not None and self.emb_transfer is not None:
            from workers.images import export

            try:  # the decode worker needs them too: to recompute after a preemption
                embeddings = export(rid, used[0], used[1], self.emb_transfer)
            except Exception as e:  # noqa: BLE001 - it encodes them itself then
                log.warning("[%s] image embeddings not exported: %s", rid, e)
        handle = PrefillHandle(
            request_id=rid,
            prefill_worker=self.spec.worker_id,
            first_token=out.token_ids[0],
            emitted_chars=len(out.text),
            prompt_tokens=out.num_prompt_tokens,
            cached_tokens=out.num_cached_tokens,
            transfer=meta,
            embeddings=embeddings,
        )
        self.send(
            Done(
                [
                    Completion(
                        rid,
                        None,
                        out.num_prompt_tokens,
                        1,
                        handle=handle,
                        cached_tokens=out.num_cached_tokens,
                        timing=out.timing,
                    )
                ]
            )
        )

    def _pull_and_decode(self, cmd: Decode, mm_inputs=None, extra=None) -> None:
        """The decode request joins the engine at once and waits there, in the loading
        state, for blocks and then for its pull (a loader thread runs ``_KVPull.load``)
        while the others keep decoding."""
        from workers.engine_api import ImportedPrefill

        handle = cmd.handle
        assert handle.first_token is not None, "a handle to pull from names its first token"
        source = _KVPull(self, cmd.request_id, handle)
        imported = ImportedPrefill(handle.first_token, handle.emitted_chars, source,
                                   handle.cached_tokens)  # fmt: skip
        self.loop.submit(engine_request(cmd, imported=imported, mm_inputs=mm_inputs,
                                        block_extra_keys=extra))  # fmt: skip

    def _vllm_decode(self, cmd: Decode) -> None:
        """Decode on vLLM: its connector pulls the KV the handle names (a failed pull is
        recomputed inside vLLM); the first token, which the prefill worker streamed, is
        not streamed again."""
        from workers.engine_api import ImportedPrefill

        handle = cmd.handle
        assert handle.first_token is not None, "a handle to decode from names its first token"
        self.publisher.start_at(cmd.request_id, 1)
        self.loop.submit(engine_request(cmd, imported=ImportedPrefill(handle.first_token,
                                                                      handle.emitted_chars),
                                        kv_transfer_params=handle.transfer))  # fmt: skip

    def _transfer_failed(self, rid: str, why: str) -> None:
        log.warning("[%s] %s", rid, why)
        self.send(Done([Completion(rid, "error", error=why, transfer_failed=True)]))

    def _listen_releases(self) -> None:
        """Prefill side: decode workers tell us when they have pulled a request's KV."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(kv_release_channel(self.spec.worker_id))
        while not self._stop.is_set():
            try:
                msg = pubsub.get_message(timeout=1.0)
            except Exception as e:  # noqa: BLE001 - reconnect and go on
                log.warning("kv-release listener: %s", e)
                time.sleep(0.5)
                continue
            if msg is None or msg.get("type") != "message":
                continue
            rid = msg["data"].decode()
            meta = self.exports.pop(rid, None)
            self.loop.call(methodcaller("release_pinned", rid))
            if meta is not None:
                self.pool.submit(self.transfer.discard, rid, meta)

    def _listen_control(self) -> None:
        """Commands to every engine process (cluster.keys.CONTROL_CHANNEL, JSON), each
        answered in its reply hash under this worker's id: ``reset_prefix_cache``
        (``reset_external``), ``pause`` (``mode``, ``clear_cache``) and ``resume``. The
        deployment's pause is also read from its key every PAUSE_SYNC_S (and after a lost
        connection), so a process that missed a command or started meanwhile follows it."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(CONTROL_CHANNEL)
        next_sync = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_sync:
                    self._sync_pause()
                    next_sync = time.monotonic() + PAUSE_SYNC_S
                msg = pubsub.get_message(timeout=1.0)
                if msg is None or msg.get("type") != "message":
                    continue
                self._control(json.loads(msg["data"]))
            except Exception as e:  # noqa: BLE001 - a bad command or Redis away: go on
                log.warning("control listener: %s", e)
                next_sync = 0.0  # a command may have gone by meanwhile
                time.sleep(0.5)

    def _answer(self, cmd: dict, answer: dict) -> None:
        key = control_reply_key(str(cmd["id"]))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, self.spec.worker_id, json.dumps(answer))
        pipe.expire(key, CONTROL_REPLY_TTL_S)
        pipe.execute()

    def _sync_pause(self) -> None:
        """Follow the deployment's pause as its key says, where this process differs: a
        pause found here holds what comes (``keep``); what runs was never told to stop."""
        wanted = self.redis.exists(PAUSED_KEY) > 0
        if wanted != self._pause_wanted:
            log.info("the deployment is %s: following it", "paused" if wanted else "resumed")
            self._pause_wanted = wanted
            if wanted:
                self.loop.pause("keep")
            else:
                self.loop.resume()

    def _control(self, cmd: dict) -> None:
        """Run one control command; answered (``success``, a ``message`` if not) now, or,
        for a pause, once this engine is paused (a thread of its own writes it)."""
        op, pool = cmd.get("op"), self.spec.pool
        if op in ("pause", "resume"):
            self._pause_wanted = op == "pause"
            try:
                fut = (self.loop.pause(str(cmd.get("mode")), bool(cmd.get("clear_cache", True)))
                       if op == "pause" else self.loop.resume())  # fmt: skip
            except ValueError as e:
                self._answer(cmd, {"success": False, "pool": pool, "message": str(e)})
                return

            def answered(f: Future) -> None:
                r = f.result()  # a pause's {"paused", "held"}; a resume's count released
                state = r if isinstance(r, dict) else {"paused": False, "released": r}
                body = {"success": True, "pool": pool, **state}
                log.info("%s: %s", op, body)
                threading.Thread(target=self._answer, args=(cmd, body), daemon=True).start()

            fut.add_done_callback(answered)  # run on the loop's thread: no Redis there
            return
        if op != "reset_prefix_cache":
            self._answer(cmd, {"success": False, "pool": pool,
                               "message": f"unknown control command {op!r}"})  # fmt: skip
            return
        external = bool(cmd.get("reset_external"))
        ok = bool(self.loop.call(methodcaller("reset_prefix_cache", external)).result(60))
        log.info("prefix cache reset%s: %s", " (and the tiers below)" if external else "",
                 "done" if ok else "refused, blocks are in use")  # fmt: skip
        answer: dict = {"success": ok, "pool": pool}
        if not ok:
            answer["message"] = ("requests hold KV blocks (or copies to the tiers are "
                                 "under way); nothing was reset: retry when idle")  # fmt: skip
        self._answer(cmd, answer)

    def _report(self) -> None:
        while not self._stop.wait(self.spec.stats_period_s):
            try:
                self.send(Stats(self.stats()))
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.embeddings.close()
        self.loop.stop()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # the KVBM tiers' threads, the disk dir; vLLM's own processes
        if self.events is not None:
            self.events.close()  # on the publisher's connection: before it closes
        self.publisher.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.mm_pool.shutdown(wait=False, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.close()
        if self.emb_transfer is not None:
            self.emb_transfer.close()
