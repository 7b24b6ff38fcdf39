"""Run one request through the pipeline and hand back its frames.

route (one Redis round trip) -> subscribe ``tokens:{id}`` (confirmed) -> send the Celery
chain -> relay frames. Whatever way the request ends — finished, failed, timed out, or the
client gone — the subscription is closed, the router's load count released, and if the
request had not finished a cancel is signalled so the worker frees its blocks.

A request of ``n > 1`` choices is routed and sent once, and streams on one channel per
choice (:func:`kvbm.protocol.choice_stream_id`): the runner hands back a
:class:`RunningRequest` per choice, which ends, is cancelled and migrates on its own like
any stream; the route, counted once per choice, is given back a choice at a time
(:class:`ChoiceGroup`). :mod:`api.choices` relays them as one response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypedDict

import redis.asyncio as aioredis
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.admission import Admission
from api.errors import OpenAIError, redis_unavailable
from api.metrics import ApiMetrics
from api.resp import RespConnection
from api.resume import moved_commands
from api.streams import (
    StreamGap,
    StreamHub,
    StreamInterrupted,
    StreamTimeout,
    Subscription,
    WorkerLost,
    output_dropped,
)
from api.tracing import RequestTrace, request_trace
from cluster.keys import PAUSED_KEY
from cluster.lora import LoraRef
from cluster.tracing import Tracing
from kvbm.protocol import (
    CANCEL_CHANNEL,
    REQUEST_ERROR_CODES,
    ImageRef,
    Pooling,
    Resume,
    Sampling,
    StagePayload,
    TokenFrame,
    Usage,
    block_hashes,
    cancelled_key,
    choice_sampling,
    choice_stream_id,
    model_namespace,
    request_extra_keys,
    tokens_channel,
)
from tasks.app import declare_queues
from tasks.broker import deferred_publishes
from tasks.pipeline import NoLiveWorker, Plan, build_chain, plan, plan_continuation, plan_pooling
from tasks.router import PinnedWorkerMissing, Route, Router, RouterConfig, RouteRequest
from tasks.settings import Settings

log = logging.getLogger(__name__)


class _RetryPolicy(TypedDict):  # kombu's retry_policy
    max_retries: int
    interval_start: float
    interval_step: float
    interval_max: float


CANCELLED_TTL_S = 3 * 3600  # longer than the broker's visibility timeout (1 h)
# What is left synchronous of a send runs on the event loop (see Runner._send): a broker
# that fails must not hold it long, so two quick retries instead of Celery's default
# 3 x 0.2 s (and instead of kombu's 2 s + 4 s back-off when a queue is declared first).
SEND_RETRY_POLICY: _RetryPolicy = {"max_retries": 2, "interval_start": 0,
                                   "interval_step": 0.05, "interval_max": 0.05}  # fmt: skip
SEND_TIMEOUT_S = 2.0  # the asynchronous part of a send: the broker's answer, retries included
HUB_READY_TIMEOUT_S = 5.0  # a request waits up to this for the token streams' subscription


@dataclass
class RunningRequest:
    request_id: str  # of its stream (the client's id, or an attempt's: <id>.r1, <id>.m1)
    subscription: Subscription
    plan: Plan
    started: float
    first_frame: TokenFrame | None = None
    last_frame_at: float | None = None
    prefilled_task: asyncio.Task[None] | None = None  # moves its load prefill -> decode
    alive: Callable[[], Awaitable[bool]] | None = None  # are its workers alive (Runner)
    # what a migration needs: the request, and what the client was sent of it so far
    payload: StagePayload | None = None
    output_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    next_seq: int = 0
    migrations: int = 0
    prefill_pending: bool = True  # its route still counts its prompt as prefill load
    migrated: bool = False  # a lost attempt: ended by a migration, not by the client
    choice: int | None = None  # n > 1: the index of the choice this stream carries
    group: ChoiceGroup | None = None  # ... and what it shares with the others
    tenant: str = ""  # who sent it (api.tenants): its completion tokens count there
    first_token_at: float | None = None  # perf_counter
    end: TokenFrame | None = None  # its terminal frame
    trace: RequestTrace | None = None  # its request's trace, when traced (api.tracing)
    # echo with max_tokens 0: the prompt alone; the one token run for its logprobs is
    # taken off every frame as it arrives (none reaches the client or the usage)
    prompt_only: bool = False
    # what Dynamo's nvext.extra_fields show (api.nvext): who did each stage (encode,
    # prefill, decode: worker ids; a migration changes the decode worker), when its chain
    # was sent and its last frame came (perf_counter), and the share of its prompt's blocks
    # the prefilling worker held cached when it was routed (None: a prompt of no full block)
    workers: dict[str, str] = field(default_factory=dict)
    sent_at: float | None = None
    ended_at: float | None = None
    kv_hit_rate: float | None = None
    # called once the request ended whole (its last frame no error): Dynamo's speculative
    # prefill of the next turn (api.nvext.warm)
    after: Callable[[], None] | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None

    @property
    def usage(self) -> Usage | None:
        """Its terminal frame's usage (None until it ended)."""
        return self.end.usage if self.end is not None else None


@dataclass
class ChoiceGroup:
    """What the choices of an ``n > 1`` request share while they run where it was sent:
    its plan (each choice gives one of its counted requests back as it ends, or moves to
    another worker), the moving of its load from prefill to decode at its first token,
    and its stage task (skipped if redelivered once every choice is done)."""

    stream_id: str  # the request's (its stage task's) id
    left: int  # choices that have not given their share of the plan back
    prefilled_task: asyncio.Task[None] | None = None
    cancelled: bool = False  # counted in the cancelled requests already


async def wait_answer(fut: asyncio.Future, deadline: float) -> None:
    """Wait for the broker's replies ``fut`` up to ``deadline`` (loop time); TimeoutError if
    they have not come, the error reply's exception if one was an error.

    The reply's future is looked at, not raced: in a burst one turn of the loop can take
    most of a second, and a turn runs its due timers before the callbacks of the replies
    read in the turn before (and uvloop runs them before it reads the sockets). A deadline
    that cancelled the wait (``asyncio.timeout``) failed sends whose answer had come: 137
    to 661 of a 1,000-stream burst on a loaded 2-core box, as 503s (bench/stream_burst.py).
    Past the deadline the loop polls its sockets once more before giving up."""
    if not fut.done():
        await asyncio.wait((fut,), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
    if not fut.done():
        await asyncio.sleep(0)  # the loop polls its sockets before this resumes
    if not fut.done():
        fut.cancel()  # its replies, if they come, are dropped (RespConnection._reply)
        raise TimeoutError(f"the broker did not answer in {SEND_TIMEOUT_S} s")
    fut.result()


class Runner:
    def __init__(
        self,
        settings: Settings,
        client: aioredis.Redis,
        hub: StreamHub,
        metrics: ApiMetrics,
        tracing: Tracing | None = None,
    ) -> None:
        self.s = settings
        self.tracing = tracing
        # a line per request at INFO only when asked (CONVEYOR_LOG_REQUESTS)
        self._request_log = logging.INFO if settings.log_requests else logging.DEBUG
        self.hub = hub
        # The fast path: every request's routing pick, the Redis writes of its Celery
        # message (Runner._send) and its clean-up are written before the first await
        # (api.resp; docs/performance.md, "API: commands leave before the first await").
        # Off: redis-py's asyncio client, and Celery sends from a thread.
        self._fast = RespConnection(settings.effective_redis_url) \
            if settings.broker_fastpath else None  # fmt: skip
        # admission: the router's commit holds each worker to its cap (cluster-wide); the
        # bounded wait for a slot is here (api.admission)
        a = settings.admission
        self.admission = Admission(a.wait_s, a.retry_after_s, metrics)
        config = replace(RouterConfig.from_settings(settings),
                         max_requests=settings.effective_worker_max_requests)  # fmt: skip
        self.router = Router(client, config, fast=self._fast,
                             on_decision=metrics.observe_decision,
                             on_release=self.admission.notify)  # fmt: skip
        self._client = client
        # the same hash function and namespace as the workers' block pools
        self._namespace = model_namespace(settings.model_name)
        self.metrics = metrics
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        self._declared: set[str] = set()

    async def open(self) -> Runner:
        """Load the router's views of this deployment's pools (their KV indexes) now."""
        await self.router.start(*self.s.pools)
        return self

    async def aclose(self) -> None:
        await self.router.aclose()
        if self._fast is not None:
            self._fast.close()

    # ----------------------------------------------------------------------------------
    async def start(
        self, request_id: str, prompt_ids: list[int], sampling: Sampling, started: float,
        pin: str | None = None, images: list[ImageRef] | None = None,
        pooling: Pooling | None = None, priority: int = 0, lora: LoraRef | None = None,
        prompt_only: bool = False, prefill_pin: str | None = None,
    ) -> list[RunningRequest]:  # fmt: skip
        """Route, subscribe, send; then wait for the first frame (errors raise here, so a
        request that cannot run gets a proper HTTP status, not a broken stream). The
        request's streams: its own, or one per choice (``n > 1``: each has its first
        frame).

        If the chosen worker dies before the first frame, the request is sent again to
        another worker (up to ``dispatch_attempts`` in all). Each attempt streams on its own
        id (``<id>``, ``<id>.r1``, ...), so a late answer from a lost attempt can never mix
        into the stream of the next one, and is cancelled like any abandoned request.

        ``images``: the prompt's images (their bytes already in Redis); each one's content
        hash enters the hashes of the blocks its placeholders cover, as in the engine.
        ``pooling``: an embedding request (one ``embed`` task; its first frame is its last
        and carries the vector), routed by load alone (the engine neither reads nor fills
        its prefix cache for it). ``priority``: vLLM's (lower first), in the admission wait
        and the engine's waiting queue. ``lora``: the adapter it runs through (its blocks
        are named in the adapter's namespace, here and in the engine). ``prompt_only``: its
        output is dropped (:attr:`RunningRequest.prompt_only`)."""
        if not await self.hub.ready(HUB_READY_TIMEOUT_S):  # no stream could reach us
            raise streams_down()
        attempts = self.s.api.dispatch_attempts
        images = images or []
        route_req = self.route_request(prompt_ids, images, pin, lora, sampling.cache_salt) \
            if pooling is None else RouteRequest([], len(prompt_ids), pin)  # fmt: skip
        route_req.choices = sampling.n
        route_req.prefill_pin = prefill_pin
        trace = None if self.tracing is None else request_trace(
            request_id, lora.name if lora else self.s.model_name,
            sampling if pooling is None else None, len(prompt_ids), started)  # fmt: skip
        interrupted = False  # the last attempt lost its stream to a Redis restart
        for attempt in range(attempts):
            stream_id = request_id if attempt == 0 else f"{request_id}.r{attempt}"
            runs = await self._dispatch(stream_id, prompt_ids, sampling, started, route_req,
                                        images, pooling, priority, lora, trace,
                                        interrupted)  # fmt: skip
            try:
                for run in runs:
                    run.prompt_only = prompt_only
                    run.first_frame = await self._next(run)
            except WorkerLost as e:
                for run in runs:
                    self.finish(run)
                interrupted = isinstance(e, StreamInterrupted)
                if interrupted and not await self.hub.ready(self.s.api.frame_timeout_s):
                    raise streams_down() from e
                self.metrics.redispatched.inc()
                log.warning("[%s] %s before the first frame (attempt %d/%d)",
                            request_id, e, attempt + 1, attempts)  # fmt: skip
                continue
            except BaseException as e:
                for run in runs:
                    self.finish(run)
                if isinstance(e, StreamTimeout):
                    raise OpenAIError(504, f"the worker did not answer in time ({e})",
                                      "server_error", None, "timeout") from e  # fmt: skip
                raise
            refused = next((f for r in runs if (f := r.first_frame) and f.error), None)
            if refused is not None:
                for run in runs:
                    self.finish(run)
                raise frame_error(refused)
            return runs
        raise OpenAIError(503, f"{attempts} workers in a row died before answering",
                          "server_error", None, "worker_lost")  # fmt: skip

    def route_request(
        self, prompt_ids: list[int], images: list[ImageRef], pin: str | None = None,
        lora: LoraRef | None = None, cache_salt: str | None = None,
    ) -> RouteRequest:  # fmt: skip
        """What the router scores: the prompt's block hashes as the workers' block pools
        name them (the model's namespace, or its LoRA adapter's and its cache salt's; an
        image's key in the blocks it covers)."""
        bs = self.s.engine.block_size
        extra = request_extra_keys(images, len(prompt_ids), bs) if images else None
        ns = self._namespace
        if lora is not None or cache_salt:
            ns = model_namespace(self.s.model_name, lora.name if lora else None, cache_salt)
        return RouteRequest(block_hashes(prompt_ids, bs, ns, extra),
                            len(prompt_ids), pin, images=len(images))  # fmt: skip

    async def _dispatch(
        self, stream_id: str, prompt_ids: list[int], sampling: Sampling, started: float,
        route_req: RouteRequest, images: list[ImageRef] | None = None,
        pooling: Pooling | None = None, priority: int = 0, lora: LoraRef | None = None,
        trace: RequestTrace | None = None, interrupted: bool = False,
    ) -> list[RunningRequest]:  # fmt: skip
        """Route and send one attempt. ``interrupted``: the last attempt lost its stream to
        a Redis restart, after which the pool's workers are unknown until their next
        heartbeat: a pool with none waits up to two heartbeats for one."""
        planner = plan if pooling is None else plan_pooling
        t0 = time.perf_counter()
        try:
            admit = partial(self.admission.admit,
                            partial(planner, self.router, self.s, route_req), priority)  # fmt: skip
            p = await self._once_workers_known(admit, interrupted)
        except PinnedWorkerMissing as e:
            prefill = e.worker_id == route_req.prefill_pin
            raise OpenAIError(
                400,
                f"worker {e.worker_id!r} is not a live "
                + ("prefill worker" if prefill else "worker of this deployment's pools")
                + f" ({', '.join(self.s.pools)})",
                "invalid_request_error",
                "nvext.prefill_worker_id" if prefill else "worker_id",
                "worker_not_found",
            ) from None
        except NoLiveWorker as e:
            raise OpenAIError(
                503,
                f"no live worker in pool {e.pool!r}; start one with "
                f"`conveyor worker --pool {e.pool}`",
                "server_error",
                None,
                "no_live_worker",
            ) from None
        except (RedisError, OSError) as e:  # the router's state lives in Redis
            raise redis_unavailable(e, "Redis did not answer the router") from e
        if trace is not None:
            assert self.tracing is not None, "a request is traced only where tracing is on"
            trace.route(self.tracing, t0, p.steps)
        for why in p.fallbacks:
            self.metrics.disagg_fallbacks.labels(why).inc()
        n_blocks = len(route_req.block_hashes)
        for route in p.routes:
            self.metrics.routing_decisions.labels(route.pool, route.reason).inc()
            if n_blocks:
                self.metrics.overlap_ratio.labels(route.pool).observe(
                    route.overlap_blocks / n_blocks
                )
            if route.reason.startswith("kv"):
                self.metrics.routed_prefix_blocks.labels(route.pool, "chosen").inc(
                    route.overlap_blocks
                )
                self.metrics.routed_prefix_blocks.labels(route.pool, "best").inc(
                    route.best_overlap_blocks
                )
        payload = StagePayload(
            request_id=stream_id,
            model=self.s.model_name,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            created=time.time(),
            images=images or [],
            pooling=pooling,
            priority=priority,
            lora=lora,
            trace=trace.parent if trace is not None else None,
        )
        runs = []
        group = ChoiceGroup(stream_id, sampling.n) if sampling.n > 1 else None
        try:
            for i, sid in enumerate(payload.stream_ids):
                sub = await self.hub.subscribe(tokens_channel(sid))
                run = RunningRequest(sid, sub, p, started, payload=payload, trace=trace)
                if group is not None:  # what the choice would carry alone (migration)
                    run.payload = payload.model_copy(
                        update={"sampling": choice_sampling(sampling, i)})  # fmt: skip
                    run.choice, run.group = i, group
                run.alive = partial(self._alive, run)
                runs.append(run)
            await self._send(p, payload)
        except BaseException:
            for run in runs:
                self.finish(run)
            if len(runs) < len(payload.stream_ids):  # their share of the plan, never held
                await self.router.release(*p.routes)
            raise
        sent_at, workers = time.perf_counter(), plan_workers(p)
        prefilling = prefill_route(p)
        for run in runs:
            run.sent_at, run.workers = sent_at, dict(workers)
            if n_blocks and prefilling is not None:
                run.kv_hit_rate = prefilling.overlap_blocks / n_blocks
        if log.isEnabledFor(self._request_log):
            log.log(self._request_log, "[%s] sent %s (%d prompt tokens%s)%s", stream_id,
                    " -> ".join(f"{n}@{r.queue}" for n, r in p.steps), len(prompt_ids),
                    f", {len(images)} images" if images else "",
                    f" [fell back: {', '.join(p.fallbacks)}]" if p.fallbacks else "")  # fmt: skip
        return runs

    async def _send(self, p: Plan, payload: StagePayload) -> None:
        """Declare every queue the chain will reach (once per queue), then send it. Later
        links travel by exchange and routing key; declaring here means a link can never
        be dropped for want of a binding.

        Fast path: Celery builds the message on the event loop, its Redis writes (the
        LPUSH and the task-sent event) are recorded (:func:`tasks.broker.deferred_publishes`)
        and ``self._fast`` writes them before the first await, in one round trip whose
        answer the loop does not wait on (docs/performance.md, "API: deferred sends").
        Stock path: Celery sends it from a thread."""
        try:
            fresh = [r.queue for r in p.routes if r.queue not in self._declared]
            if fresh:  # once per queue: synchronous, with the short retry policy
                declare_queues(fresh, retry_policy=SEND_RETRY_POLICY)
                self._declared.update(fresh)
            sig = build_chain(p, payload)
            # declare=[]: declared above, once per queue (kombu checks each message else;
            # docs/performance.md, "API: queues declared once")
            if self._fast is None:
                await asyncio.to_thread(sig.apply_async, retry_policy=SEND_RETRY_POLICY,
                                        declare=[])  # fmt: skip
                return
            with deferred_publishes() as writes:
                sig.apply_async(retry_policy=SEND_RETRY_POLICY, declare=[])
            # Celery's broker is ``effective_redis_url`` too (tasks.app.configure), so the
            # writes go to the same Redis as the pick. Empty when the broker's transport
            # sent the message itself (a broker neither redis:// nor rediss://: tasks.broker).
            if writes:
                deadline = asyncio.get_running_loop().time() + SEND_TIMEOUT_S
                async with asyncio.timeout_at(deadline):  # inline, unlike wait_for
                    answer = await self._send_writes(self._fast, writes)
                await wait_answer(answer, deadline)
        except (KombuOperationalError, RedisError, OSError, TimeoutError) as e:
            raise OpenAIError(503, f"the broker did not take the request: {e}",
                              "server_error", None, "broker_unavailable") from e  # fmt: skip

    @staticmethod
    async def _send_writes(broker: RespConnection, writes: list[tuple]) -> asyncio.Future:
        """The writes leave before the first ``await`` (:class:`api.resp.RespConnection`);
        a broker not connected is tried as often and as briefly as SEND_RETRY_POLICY says.
        Returns the future of their replies. Once written, a lost connection is not
        retried: the message may have landed."""
        for attempt in range(SEND_RETRY_POLICY["max_retries"] + 1):
            if broker.connected:
                break
            try:
                await broker.connect()
            except RedisConnectionError:
                if attempt == SEND_RETRY_POLICY["max_retries"]:
                    raise
                await asyncio.sleep(SEND_RETRY_POLICY["interval_step"])
        return broker.send(*writes)

    async def batches(self, run: RunningRequest) -> AsyncIterator[list[TokenFrame]]:
        """A started request's frames, the first included, up to the terminal one, in
        lists: each holds a frame that was waited for and those that had already arrived
        behind it. A stream that fell behind (the API busy) catches up in one SSE chunk
        rather than one per token, as vLLM merges the outputs a client has not taken yet;
        a stream that keeps up gets one per token. Frames come straight from the
        subscription (no generator per layer: this runs once per token per stream)."""
        assert run.first_frame is not None, "batches() before start() returned"
        frame = run.first_frame
        while True:
            batch = [frame]
            while not frame.done:
                more = run.subscription.poll()
                if more is None:
                    break
                self._observe(run, more)
                batch.append(more)
                frame = more
            yield batch
            if frame.done:
                return
            while True:
                try:
                    frame = await self._next(run)
                    break
                except WorkerLost as e:
                    await self._migrate(run, e)  # raises when it cannot

    async def _migrate(self, run: RunningRequest, lost: WorkerLost) -> None:
        """The worker streaming ``run`` died mid-generation: carry the stream on from
        prompt + the tokens the client has, on another live worker of its pool, on a new
        stream id (a late frame of the lost attempt can never reach the client), up to
        ``migration_limit`` times. Raises ``lost`` when it cannot."""
        assert run.payload is not None
        dead = run.plan.routes[-1]
        if run.migrations >= self.s.api.migration_limit or not run.output_ids:
            raise lost
        if isinstance(lost, StreamInterrupted) and not await self.hub.ready(
            self.s.api.frame_timeout_s
        ):  # Redis dropped again before the stream could go on: it goes on once Redis is back
            raise lost
        t0 = time.perf_counter()
        old = replace(run, migrated=True)  # the lost attempt: cancelled and released
        self.finish(old)
        run.migrations += 1
        base = run.payload.request_id.split(".", 1)[0]  # the client's id
        if run.choice is not None:  # a choice goes on alone (its payload: n=1, its seed)
            base, run.group = choice_stream_id(base, run.choice), None
        stream_id = f"{base}.m{run.migrations}"
        prompt = run.payload.prompt_token_ids
        route_req = self.route_request(prompt + run.output_ids, run.payload.images,
                                       lora=run.payload.lora,
                                       cache_salt=run.payload.sampling.cache_salt)  # fmt: skip
        if not isinstance(lost, StreamInterrupted):  # its worker lives: it may serve it again
            route_req.exclude = {dead.worker_id}
        route_req.admitted = True  # accepted already: the worker cap does not refuse it
        try:
            p = await self._once_workers_known(
                partial(plan_continuation, self.router, dead.pool, route_req),
                isinstance(lost, StreamInterrupted),
            )
        except NoLiveWorker:
            self.metrics.migrations.labels(dead.pool, "no_worker").inc()
            raise type(lost)(f"{lost}; no other live {dead.pool} worker to move to") from None
        resume = Resume(output_token_ids=run.output_ids, emitted_chars=run.emitted_chars,
                        next_seq=run.next_seq, migration=run.migrations)  # fmt: skip
        payload = run.payload.model_copy(update={"request_id": stream_id, "resume": resume})
        try:
            sub = await self.hub.subscribe(tokens_channel(stream_id), start_seq=run.next_seq)
        except BaseException:
            await self.router.release(*p.routes)
            raise
        run.request_id, run.subscription, run.plan = stream_id, sub, p
        run.workers["decode_worker_id"] = p.routes[-1].worker_id
        run.prefill_pending, run.prefilled_task = True, None
        try:
            if self.s.api.resumable_streams:  # a resume reading the old log follows it
                pipe = self._client.pipeline(transaction=False)
                for command in moved_commands(old.request_id, stream_id, run.next_seq):
                    pipe.execute_command(*command)
                await pipe.execute()
            await self._send(p, payload)
        except BaseException:
            self.finish(replace(run, migrated=True))
            raise
        self.metrics.migrations.labels(dead.pool, "moved").inc()
        log.warning("[%s] %s after %d tokens: moved to %s as %s (migration %d/%d, %.0f ms)",
                    base, lost, len(run.output_ids), p.routes[0].worker_id, stream_id,
                    run.migrations, self.s.api.migration_limit,
                    (time.perf_counter() - t0) * 1000)  # fmt: skip

    @property
    def _reregister_s(self) -> float:
        """How long a live worker may stay unknown to a Redis that came back without its
        data: until its next heartbeat registers it again (two, to be sure)."""
        return 2 * self.s.worker.heartbeat_s

    async def _once_workers_known(self, pick: Callable[[], Awaitable[Plan]],
                                  interrupted: bool) -> Plan:  # fmt: skip
        """``pick()`` (a plan); for a stream a Redis restart interrupted, a pool with no
        live worker is asked again for up to :attr:`_reregister_s` before it counts."""
        deadline = time.monotonic() + (self._reregister_s if interrupted else 0)
        while True:
            try:
                return await pick()
            except NoLiveWorker:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def hold(self, task: asyncio.Task[None]) -> None:
        """Keep a request's background task referenced until it is done."""
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    def finish(self, run: RunningRequest) -> None:
        """Release everything the request holds; cancel it on the worker if unfinished.
        Runs as a detached task so it completes even when the caller is being cancelled."""
        if run.trace is not None and not run.migrated:  # before the response's span ends
            end = run.end
            # a stream is its prompt's (a batch's prompts each have an id) and choice's: a
            # retried attempt ends under the same key as the one it replaces
            stream = (run.request_id.split(".", 1)[0], run.choice or 0)
            run.trace.ended(stream, run.usage, end.finish_reason if end else None,
                            end.error.message if end and end.error else None,
                            run.first_token_at, run.migrations)  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._cleanup(run))
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    # ----------------------------------------------------------------------------------
    async def _next(self, run: RunningRequest) -> TokenFrame:
        """The request's next frame (waited for, with the timeouts and liveness checks of
        :meth:`api.streams.Subscription.next_frame`), observed for the metrics."""
        first = run.first_frame is None
        frame = await run.subscription.next_frame(
            self.s.api.first_frame_timeout_s if first else self.s.api.frame_timeout_s,
            run.alive,
            check_every=min(1.0, self.s.worker.heartbeat_s),
            paused=self._paused,
        )
        self._observe(run, frame)
        return frame

    async def _paused(self) -> bool:
        """Whether the deployment is paused (/pause): a request's frames may wait for its
        /resume however long; asked only when a frame timeout runs out."""
        try:
            return await self._client.exists(PAUSED_KEY) > 0
        except (RedisError, OSError):
            return False

    async def _alive(self, run: RunningRequest) -> bool:
        # Before the first frame every stage's worker matters; after it, only the last
        # one's (a prefill worker may come and go once it handed over the KV).
        routes = run.plan.routes if run.first_frame is None else run.plan.routes[-1:]
        try:
            live = await self.router.all_live(routes)
        except (RedisError, OSError) as e:
            # Redis away (restarting): liveness is unknown, not lost. The request waits on
            # for its frames, within its frame timeout, as its worker does for Redis.
            log.warning("[%s] liveness check failed (%s); still waiting", run.request_id, e)
            return True
        if not live and (
            not self.hub.up or time.monotonic() - self.hub.restored_at < self._reregister_s
        ):
            # Redis just came back (the hub not yet, or not long ago), perhaps without its
            # data: a live worker is unknown to it until its next heartbeat, so not found is
            # not yet dead
            return True
        return live

    def _observe(self, run: RunningRequest, frame: TokenFrame) -> None:
        now = time.perf_counter()
        run.next_seq = frame.seq + 1
        if frame.token_ids:
            run.output_ids += frame.token_ids
            run.emitted_chars += len(frame.text)
            if run.prefill_pending:
                run.prefill_pending = False
                self._forget_prefill(run)
            if run.last_frame_at is None:
                run.first_token_at = now
                if not run.choice:  # one per request: its first choice's
                    self.metrics.ttft.observe(now - run.started)
                    self.metrics.traffic.first_token(now - run.started)
            else:
                self.metrics.itl.observe(now - run.last_frame_at)
                self.metrics.traffic.token_gap(now - run.last_frame_at)
            run.last_frame_at = now
        if frame.done:
            run.end, run.ended_at = frame, now
        if run.prompt_only:
            output_dropped(frame)

    def _forget_prefill(self, run: RunningRequest) -> None:
        """The first token is out: the prompt no longer queues for prefill anywhere (the
        release at the end waits for this, so the two never cross in Redis). Choices that
        share their request's plan move its load once."""
        g = run.group
        if g is not None and g.prefilled_task is not None:
            run.prefilled_task = g.prefilled_task
            return
        run.prefilled_task = asyncio.get_running_loop().create_task(self._prefilled(run))
        if g is not None:
            g.prefilled_task = run.prefilled_task

    async def _prefilled(self, run: RunningRequest) -> None:
        try:
            for route in run.plan.routes:
                await self.router.prefilled(route)
        except Exception:  # noqa: BLE001 - the release at the end gives it back anyway
            log.warning("[%s] could not update prefill load", run.request_id)

    async def _cleanup(self, run: RunningRequest) -> None:
        g = run.group
        try:
            prefilled = run.prefilled_task or (g.prefilled_task if g is not None else None)
            if prefilled is not None:
                await prefilled
            await run.subscription.close()
            # The key makes a copy of the task that the broker redelivers later (its worker
            # died holding it) skip the work; the message aborts a running one now.
            commands: list[tuple] = [
                ("SET", cancelled_key(run.request_id), 1, "EX", CANCELLED_TTL_S)
            ]
            if not run.finished:
                if not run.migrated and not (g is not None and g.cancelled):
                    self.metrics.cancelled.inc()
                    log.info("[%s] not finished: cancelling on the worker", run.request_id)
                if g is not None:
                    g.cancelled = g.cancelled or not run.migrated
                commands.append(("PUBLISH", CANCEL_CHANNEL, run.request_id))
            if g is not None:
                g.left -= 1
                if not g.left:  # every choice is done with the request's task
                    commands.append(("SET", cancelled_key(g.stream_id), 1, "EX",
                                     CANCELLED_TTL_S))  # fmt: skip
            # one write: each write to Redis on a shared core lets Redis (and whatever it
            # wakes) run before the loop goes on (docs/performance.md, "API: clean-up in
            # one write")
            await self.router.release(*run.plan.routes, before=tuple(commands),
                                      one=g is not None)  # fmt: skip
        except Exception:  # noqa: BLE001 - best effort; counters expire anyway
            log.exception("[%s] cleanup failed", run.request_id)


def prefill_route(p: Plan) -> Route | None:
    """The plan's route that computes the prompt (a generate task's does both)."""
    return next((r for task, r in p.steps if task in ("prefill", "generate")), None)


def plan_workers(p: Plan) -> dict[str, str]:
    """Who does what in a plan, as Dynamo's ``nvext`` worker_id names it: the worker that
    prefills (:func:`prefill_route`), the one that decodes, and the encode worker where an
    encode stage runs (Conveyor's addition)."""
    out: dict[str, str] = {}
    prefilling = prefill_route(p)
    for task, route in p.steps:
        if task == "encode":
            out["encode_worker_id"] = route.worker_id
        if route is prefilling:
            out["prefill_worker_id"] = route.worker_id
        if task in ("decode", "generate"):
            out["decode_worker_id"] = route.worker_id
    return out


# The status of an error a worker reports before the first token (the response has not
# started): a request the engine refuses is the caller's to fix (400, REQUEST_ERROR_CODES);
# an image whose bytes are gone from Redis (it waited past their TTL) may be sent again;
# anything else is ours.
FRAME_ERROR_STATUS = {"image_unavailable": 503}


def frame_error(frame: TokenFrame) -> OpenAIError:
    """The error a worker's error frame reports, as the client gets it."""
    err = frame.error
    assert err is not None, "frame_error of a frame without an error"
    code = err.code or ""
    status = 400 if code in REQUEST_ERROR_CODES else FRAME_ERROR_STATUS.get(code, 500)
    return OpenAIError(status, err.message, err.type, err.param, err.code)


def stream_failed(e: BaseException, rid: str) -> OpenAIError:
    """A stream that failed after its first event: the error event the client gets, logged
    once here for every kind of stream (chat, completions, choices, Responses)."""
    err = stream_error(e)
    log.warning("[%s] stream ended with error: %s", rid, err.message)
    return err


def streams_down() -> OpenAIError:
    """503: the token streams' subscription is down (Redis away), so no answer could come."""
    return OpenAIError(503, "Redis is not answering (token streams are down)", "server_error",
                       None, "redis_unavailable")  # fmt: skip


def stream_error(e: BaseException) -> OpenAIError:
    """Map a failure in the middle of a stream to the error event the client gets."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, StreamTimeout):
        return OpenAIError(504, f"the worker stopped answering ({e})", "server_error", None,
                           "timeout")  # fmt: skip
    if isinstance(e, StreamInterrupted):
        return OpenAIError(503, f"the token stream was interrupted ({e}); retry the request",
                           "server_error", None, "redis_unavailable")  # fmt: skip
    if isinstance(e, WorkerLost):
        return OpenAIError(503, f"the worker died mid-generation ({e}); retry the request",
                           "server_error", None, "worker_lost")  # fmt: skip
    if isinstance(e, StreamGap):
        return OpenAIError(500, f"token stream broken: {e}", "server_error", None, "stream_gap")
    if isinstance(e, (RedisConnectionError, RedisTimeoutError)):
        return redis_unavailable(e)
    return OpenAIError(500, f"internal error: {type(e).__name__}", "server_error", None, None)
