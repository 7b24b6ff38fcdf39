"""Run one request through the pipeline and hand back its frames.

route (one Redis round trip) -> subscribe ``tokens:{id}`` (confirmed) -> send the Celery
chain -> relay frames. Whatever way the request ends — finished, failed, timed out, or the
client gone — the subscription is closed, the router's load count released, and if the
request had not finished a cancel is signalled so the worker frees its blocks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from api.errors import OpenAIError
from api.metrics import ApiMetrics
from api.resp import RespConnection
from api.streams import StreamGap, StreamHub, StreamTimeout, Subscription, WorkerLost
from kvbm.hashing import block_hashes, namespace_hash
from tasks.app import declare_queues, records_publishes
from tasks.broker import deferred_publishes
from tasks.channels import CANCEL_CHANNEL, CANCELLED_KEY, tokens_channel
from tasks.payloads import GeneratePayload
from tasks.pipeline import NoLiveWorker, Plan, build_chain, plan
from tasks.router import PinnedWorkerMissing, Push, Route, Router, RouterConfig, RouteRequest
from tasks.settings import Settings

log = logging.getLogger(__name__)

CANCELLED_TTL_S = 3 * 3600  # longer than the broker's visibility timeout (1 h)
# What is left synchronous of a send runs on the event loop (see Runner._send): a broker
# that fails must not hold it long, so two quick retries instead of Celery's default
# 3 x 0.2 s (and instead of kombu's 2 s + 4 s back-off when a queue is declared first).
SEND_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.05,
                     "interval_max": 0.05}  # fmt: skip
SEND_TIMEOUT_S = 2.0  # the asynchronous part of a send: the broker's answer, retries included


@dataclass
class RunningRequest:
    request_id: str
    subscription: Subscription
    plan: Plan
    started: float
    first_frame: dict | None = None
    finished: bool = False
    last_frame_at: float | None = None
    usage: dict = field(default_factory=dict)
    prefilled_task: asyncio.Task[None] | None = None  # moves its load prefill -> decode
    alive: Callable[[], Awaitable[bool]] | None = None  # are its workers alive (Runner)


class Runner:
    def __init__(
        self,
        settings: Settings,
        client: aioredis.Redis,
        hub: StreamHub,
        metrics: ApiMetrics,
    ) -> None:
        self.s = settings
        self.hub = hub
        # Written before the first await (api.resp): every request's routing pick, the
        # Redis writes of its Celery message (Runner._send), and its clean-up (the load
        # given back, the cancelled key): ~40 us of CPU per call, against ~100 through redis-py.
        self._fast = RespConnection(settings.effective_redis_url)
        self.router = Router(client, router_config(settings), fast=self._fast)
        self._namespace = namespace_hash(settings.model_name)
        self.metrics = metrics
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        self._declared: set[str] = set()
        # stands for the worker id in a task built before its worker is picked
        self._mark = f"conveyormark{secrets.token_hex(8)}"

    async def aclose(self) -> None:
        self._fast.close()

    # ----------------------------------------------------------------------------------
    async def start(
        self, request_id: str, prompt_ids: list[int], sampling: dict, started: float,
        pin: str | None = None,
    ) -> RunningRequest:  # fmt: skip
        """Route, subscribe, send; then wait for the first frame (errors raise here, so a
        request that cannot run gets a proper HTTP status, not a broken stream).

        If the chosen worker dies before the first frame, the request is sent again to
        another worker (up to ``dispatch_attempts`` in all). Each attempt streams on its own
        id (``<id>``, ``<id>.r1``, ...), so a late answer from a lost attempt can never mix
        into the stream of the next one, and is cancelled like any abandoned request."""
        attempts = self.s.dispatch_attempts
        # the same hash function and namespace as the workers' block pools
        hashes = block_hashes(prompt_ids, self.s.block_size, self._namespace)
        route_req = RouteRequest(hashes, len(prompt_ids), pin)
        for attempt in range(attempts):
            stream_id = request_id if attempt == 0 else f"{request_id}.r{attempt}"
            run = await self._dispatch(stream_id, prompt_ids, sampling, started, route_req)
            try:
                run.first_frame = await self._next(run)
            except WorkerLost as e:
                self.finish(run)
                self.metrics.redispatched.inc()
                log.warning("[%s] %s before the first frame (attempt %d/%d)",
                            request_id, e, attempt + 1, attempts)  # fmt: skip
                continue
            except BaseException as e:
                self.finish(run)
                if isinstance(e, StreamTimeout):
                    raise OpenAIError(504, f"the worker did not answer in time ({e})",
                                      "server_error", None, "timeout") from e  # fmt: skip
                raise
            if run.first_frame.get("error") and run.first_frame.get("done"):
                self.finish(run)
                raise frame_error(run.first_frame)
            return run
        raise OpenAIError(503, f"{attempts} workers in a row died before answering",
                          "server_error", None, "worker_lost")  # fmt: skip

    async def _dispatch(
        self, stream_id: str, prompt_ids: list[int], sampling: dict, started: float,
        route_req: RouteRequest,
    ) -> RunningRequest:  # fmt: skip
        sub = await self.hub.subscribe(tokens_channel(stream_id))
        payload = GeneratePayload(
            request_id=stream_id,
            model=self.s.model_name,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            created=time.time(),
        )
        run = await self._route_and_send(sub, payload, started, route_req)
        p = run.plan
        log.info("[%s] sent %s (%d prompt tokens)%s", stream_id,
                 " -> ".join(f"{n}@{r.queue}" for n, r in p.steps), len(prompt_ids),
                 f" [aggregated: {p.fallback}]" if p.fallback else "")  # fmt: skip
        return run

    async def _route_and_send(
        self, sub: Subscription, payload: GeneratePayload, started: float,
        route_req: RouteRequest,
    ) -> RunningRequest:  # fmt: skip
        run = None
        try:
            folded = None
            if self._folds(route_req):
                folded = await self._route_and_push(route_req, payload)
            if folded is None:
                p = await self._plan(route_req)
                run = self._running(sub, payload, p, started, route_req)
                await self._send(p, payload)
            else:
                p, event = folded
                run = self._running(sub, payload, p, started, route_req)
                await self._send_event(payload.request_id, event)
        except BaseException:
            if run is not None:
                self.finish(run)  # gives back what the pick counted, cancels what was sent
            else:
                await sub.close()
            raise
        return run

    def _running(self, sub: Subscription, payload: GeneratePayload, p: Plan, started: float,
                 route_req: RouteRequest) -> RunningRequest:  # fmt: skip
        """The request routed by ``p``, counted in the routing metrics."""
        if p.fallback is not None:
            self.metrics.disagg_fallbacks.labels(p.fallback).inc()
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
        run = RunningRequest(payload.request_id, sub, p, started)
        run.alive = partial(self._alive, run)
        return run

    async def _plan(self, route_req: RouteRequest) -> Plan:
        try:
            return await plan(self.router, self.s, route_req)
        except (PinnedWorkerMissing, NoLiveWorker, RedisError, OSError) as e:
            raise routing_error(e, self.s.pools) from None

    def _folds(self, route_req: RouteRequest) -> bool:
        """Whether the request's task can ride in its routing pick (:meth:`_route_and_push`):
        one stage (agg), no pinned worker, and a broker whose writes are recorded."""
        return self.s.mode == "agg" and not route_req.pin and records_publishes()

    async def _route_and_push(
        self, route_req: RouteRequest, payload: GeneratePayload
    ) -> tuple[Plan, tuple] | None:
        """Route an aggregated request and queue its task in one round trip.

        The task message is built first, for the queue of a stand-in worker id
        (``self._mark``), and the pick script pushes it onto the chosen worker's queue
        with the real id in its place (:class:`tasks.router.Push`). Sent after the pick,
        it waited for the pick's answer to come back through the busy API loop: at 16
        streams that was 1.8 ms (mean) of every request's time to first token.

        Returns the plan and the task-sent event to publish (its body is base64, which the
        script cannot edit: corrected here). ``None``: the message did not come out as
        expected and nothing was sent; route and send the usual way. A pick whose answer
        is lost (the connection dropped, the caller was cancelled) may have queued the
        task: the request is cancelled by its id. What the pick counted against the worker
        stays counted until the load hash expires, as when a pick of :func:`plan` is lost."""
        stand_in = Route("generate", self._mark, {})
        try:
            with deferred_publishes() as writes:
                build_chain(Plan([("generate", stand_in)]), payload).apply_async(
                    retry_policy=SEND_RETRY_POLICY, declare=[]
                )
        except (KombuOperationalError, RedisError, OSError) as e:
            raise broker_error(e) from e
        if [w[0] for w in writes] != ["LPUSH", "PUBLISH"] or writes[0][1] != stand_in.queue:
            log.warning("unexpected broker writes %s; routing first, then sending",
                        [w[:2] for w in writes])  # fmt: skip
            return None
        push = Push(self._mark, writes[0][1], writes[0][2])
        try:
            route = await self.router.pick("generate", route_req, push)
        except BaseException as e:
            # the script may have queued the task before its answer was lost (a dropped
            # connection, the caller cancelled): no one would hear it
            self._detach(self._cancel(payload.request_id))
            if isinstance(e, RedisError | OSError):
                raise routing_error(e, self.s.pools) from None
            raise
        if route is None:
            raise routing_error(NoLiveWorker("generate"), self.s.pools)
        return Plan([("generate", route)]), retarget_event(writes[1], self._mark, route.worker_id)

    async def _send_event(self, request_id: str, event: tuple) -> None:
        """Publish a task-sent event; the task is queued already, so a failure is logged."""
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self._send_writes([event])
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("[%s] task-sent event not published: %s", request_id, e)

    async def _send(self, p: Plan, payload: GeneratePayload) -> None:
        """Declare every queue the chain will reach (once per queue), then send it. Later
        links travel by exchange and routing key; declaring here means a link can never
        be dropped for want of a binding.

        Celery builds the message on the event loop (~0.8 ms of Python at c=16; in a
        thread it traded the GIL with this busy loop at every socket call: 8 ms at c=4).
        Its Redis writes (the LPUSH and the task-sent event) are recorded
        (:func:`tasks.broker.deferred_publishes`) and written by ``self._fast`` before
        the first await, in one round trip whose answer the loop does not wait on: sent
        synchronously they held the loop 3.1 ms p50 per request at c=16, with every
        stream's frames behind them; through redis-py's asyncio client they left only
        at the loop's next turn, ~8 ms later at c=16, and TTFT and throughput fell."""
        try:
            fresh = [r.queue for r in p.routes if r.queue not in self._declared]
            if fresh:  # once per queue: synchronous, with the short retry policy
                declare_queues(fresh, retry_policy=SEND_RETRY_POLICY)
                self._declared.update(fresh)
            with deferred_publishes() as writes:
                # declare=[]: declared above, once per queue; kombu's per-message check
                # (a bound copy of the queue looked up in its cache) was a third of a send
                build_chain(p, payload).apply_async(retry_policy=SEND_RETRY_POLICY,
                                                    declare=[])  # fmt: skip
            # Celery's broker is ``effective_redis_url`` too (tasks.app.configure), so the
            # writes go to the same Redis as the pick. Empty when the broker's transport
            # sent the message itself (only a redis:// broker defers, see tasks.broker).
            if writes:
                async with asyncio.timeout(SEND_TIMEOUT_S):  # inline, unlike wait_for
                    await self._send_writes(writes)
        except (KombuOperationalError, RedisError, OSError, TimeoutError) as e:
            raise broker_error(e) from e

    async def _send_writes(self, writes: list[tuple]) -> None:
        """The writes leave before the first ``await`` (:class:`api.resp.RespConnection`);
        a broker not connected is tried as often and as briefly as SEND_RETRY_POLICY says.
        Once written, a lost connection is not retried: the message may have landed."""
        broker = self._fast
        for attempt in range(SEND_RETRY_POLICY["max_retries"] + 1):
            if broker.connected:
                break
            try:
                await broker.connect()
            except RedisConnectionError:
                if attempt == SEND_RETRY_POLICY["max_retries"]:
                    raise
                await asyncio.sleep(SEND_RETRY_POLICY["interval_step"])
        await broker.send(*writes)

    async def batches(self, run: RunningRequest) -> AsyncIterator[list[dict]]:
        """A started request's frames, the first included, up to the terminal one, in
        lists: each holds a frame that was waited for and those that had already arrived
        behind it. A stream that fell behind (the API busy) catches up in one SSE chunk
        rather than one per token, as vLLM merges the outputs a client has not taken yet;
        a stream that keeps up gets one per token. Frames come straight from the
        subscription (no generator per layer: this runs once per token per stream)."""
        assert run.first_frame is not None, "batches() before start() returned"
        frame = run.first_frame
        sub = run.subscription
        while True:
            batch = [frame]
            while not frame.get("done"):
                more = sub.poll()
                if more is None:
                    break
                self._observe(run, more)
                batch.append(more)
                frame = more
            yield batch
            if frame.get("done"):
                return
            frame = await self._next(run)

    def finish(self, run: RunningRequest) -> None:
        """Release everything the request holds; cancel it on the worker if unfinished.
        Runs as a detached task so it completes even when the caller is being cancelled."""
        self._detach(self._cleanup(run))

    def _detach(self, cleanup: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(cleanup)
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    async def _cancel(self, request_id: str) -> None:
        """Cancel a request that may be queued or running, its route unknown."""
        try:
            await self._fast.execute(*cancel_commands(request_id))
        except Exception as e:  # noqa: BLE001 - best effort, as every clean-up
            log.warning("[%s] could not cancel: %s", request_id, e)

    # ----------------------------------------------------------------------------------
    async def _next(self, run: RunningRequest) -> dict:
        """The request's next frame (waited for, with the timeouts and liveness checks of
        :meth:`api.streams.Subscription.next_frame`), observed for the metrics."""
        first = run.first_frame is None
        frame = await run.subscription.next_frame(
            self.s.first_frame_timeout_s if first else self.s.frame_timeout_s,
            run.alive,
            check_every=min(1.0, self.s.heartbeat_s),
        )
        self._observe(run, frame)
        return frame

    async def _alive(self, run: RunningRequest) -> bool:
        # Before the first frame every stage's worker matters; after it, only the last
        # one's (a prefill worker may come and go once it handed over the KV).
        routes = run.plan.routes if run.first_frame is None else run.plan.routes[-1:]
        return await self.router.all_alive(routes)

    def _observe(self, run: RunningRequest, frame: dict) -> None:
        now = time.perf_counter()
        if frame.get("token_ids"):
            if run.last_frame_at is None:
                self.metrics.ttft.observe(now - run.started)
                self._forget_prefill(run)
            else:
                self.metrics.itl.observe(now - run.last_frame_at)
            run.last_frame_at = now
        if frame.get("done"):
            run.finished = True
            run.usage = frame.get("usage") or {}

    def _forget_prefill(self, run: RunningRequest) -> None:
        """The first token is out: the prompt no longer queues for prefill anywhere (the
        release at the end waits for this, so the two never cross in Redis)."""
        run.prefilled_task = asyncio.get_running_loop().create_task(self._prefilled(run))

    async def _prefilled(self, run: RunningRequest) -> None:
        try:
            for route in run.plan.routes:
                await self.router.prefilled(route)
        except Exception:  # noqa: BLE001 - the release at the end gives it back anyway
            log.warning("[%s] could not update prefill load", run.request_id)

    async def _cleanup(self, run: RunningRequest) -> None:
        try:
            if run.prefilled_task is not None:
                await run.prefilled_task
            await run.subscription.close()
            # the cancelled key for every request, the cancel message for an unfinished one
            commands = cancel_commands(run.request_id, publish=not run.finished)
            if not run.finished:
                self.metrics.cancelled.inc()
                log.info("[%s] not finished: cancelling on the worker", run.request_id)
            # one write: each write to Redis on a shared core lets Redis (and whatever it
            # wakes) run before the loop goes on (~0.4 ms per write at c=16 here)
            await self.router.release(*run.plan.routes, before=commands)
        except Exception:  # noqa: BLE001 - best effort; counters expire anyway
            log.exception("[%s] cleanup failed", run.request_id)


def router_config(s: Settings) -> RouterConfig:
    return RouterConfig(
        mode=s.router_mode,
        kv_events=s.router_kv_events,
        approx_ttl_s=s.router_approx_ttl_s,
        overlap_weight=s.router_overlap_weight,
        temperature=s.router_temperature,
        guard_ratio=s.router_guard_ratio,
        guard_min_blocks=s.router_guard_min_blocks,
        block_size=s.block_size,
    )


def cancel_commands(request_id: str, publish: bool = True) -> tuple[tuple, ...]:
    """The key that makes a copy of the request's task the broker redelivers later (its
    worker died holding it) skip the work, and the message that aborts a running one."""
    key = ("SET", CANCELLED_KEY.format(request_id), 1, "EX", CANCELLED_TTL_S)
    return (key, ("PUBLISH", CANCEL_CHANNEL, request_id)) if publish else (key,)


def routing_error(e: Exception, pools: list[str] | tuple[str, ...]) -> OpenAIError:
    """What the client gets when its request could not be routed."""
    if isinstance(e, PinnedWorkerMissing):
        return OpenAIError(
            400,
            f"worker {e.worker_id!r} is not a live worker of this deployment's pools "
            f"({', '.join(pools)})",
            "invalid_request_error",
            "worker_id",
            "worker_not_found",
        )
    if isinstance(e, NoLiveWorker):
        return OpenAIError(
            503,
            f"no live worker in pool {e.pool!r}; start one with `conveyor worker --pool {e.pool}`",
            "server_error",
            None,
            "no_live_worker",
        )
    # the router's state lives in Redis
    return OpenAIError(503, f"Redis did not answer the router: {e}", "server_error", None,
                       "redis_unavailable")  # fmt: skip


def broker_error(e: Exception) -> OpenAIError:
    return OpenAIError(503, f"the broker did not take the request: {e}", "server_error", None,
                       "broker_unavailable")  # fmt: skip


def retarget_event(event: tuple, mark: str, worker_id: str) -> tuple:
    """A recorded ``PUBLISH`` of a task-sent event, with ``mark`` in its (base64) body
    replaced by ``worker_id``."""
    name, channel, raw = event
    message = json.loads(raw)
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        text = base64.b64decode(body).decode().replace(mark, worker_id)
        message["body"] = base64.b64encode(text.encode()).decode()
    else:
        message["body"] = body.replace(mark, worker_id)
    return (name, channel, json.dumps(message))


def frame_error(frame: dict) -> OpenAIError:
    """The error a worker's error frame reports, as the client gets it."""
    err = frame["error"]
    return OpenAIError(500, err.get("message", "generation failed"),
                       err.get("type", "server_error"), None, err.get("code"))  # fmt: skip


def stream_error(e: BaseException) -> OpenAIError:
    """Map a failure in the middle of a stream to the error event the client gets."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, StreamTimeout):
        return OpenAIError(504, f"the worker stopped answering ({e})", "server_error", None,
                           "timeout")  # fmt: skip
    if isinstance(e, WorkerLost):
        return OpenAIError(503, f"the worker died mid-generation ({e}); retry the request",
                           "server_error", None, "worker_lost")  # fmt: skip
    if isinstance(e, StreamGap):
        return OpenAIError(500, f"token stream broken: {e}", "server_error", None, "stream_gap")
    return OpenAIError(500, f"internal error: {type(e).__name__}", "server_error", None, None)
