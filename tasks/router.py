"""Pick the worker (and so the per-worker queue) for each stage of a request.

Each API process's :class:`Router` scores workers in-process. A request's overlap with what
each worker holds comes from a local index per pool (:class:`cluster.index.IndexFollower`,
fed by the workers' KV events through a Redis stream); each worker's load from a local view
refreshed from Redis every ``refresh_s`` and by this router's own decisions. Redis keeps
only what routers must share, and a decision costs it one small script (the ledger's commit,
:data:`cluster.ledger.COMMIT_LUA`): it re-checks that the chosen worker is live and, in kv
mode, that its true load is within the guard's limit (which this router computes from its
view of the pool), and counts the request against it, atomically. On a conflict (the worker
died, or other routers filled it past the guard) the next candidate is tried. Any number of
API replicas route consistently, and none walks the index in Redis's single thread.

Modes (``CONVEYOR_ROUTER_MODE``):

``kv`` (default)
    cost(w) = overlap_weight x (prompt blocks w would still compute + blocks of prompt
    tokens already queued for prefill on w) + active decode blocks on w. The first term
    is the work ahead of this request's first token, the second the decode load it joins.
    A cached block counts by the tier it would come from (``tier_weights``, default 1.0
    in G1, 0.75 in G2 host memory, 0.25 on G3 disk): a block on disk saves less work than
    one in the engine's pool, and a worker holding the prefix in G1 beats one holding it
    on disk, which beats one holding nothing.
    Lowest cost wins (ties broken at random), or with a temperature > 0 a softmax over
    the normalised costs. A load guard first drops workers whose load (decode blocks +
    queued prefill blocks) exceeds ``guard_ratio`` x the mean and ``guard_min_blocks``
    above the least loaded one, so a system prompt shared by every request cannot send
    all traffic to the worker that cached it first.
    With ``router_kv_events`` off (engines that emit no KV events) the index is
    approximate: routers append their own decisions to the pool's stream, and every
    router counts them as the chosen worker's cache contents for ``router_approx_ttl_s``.
``round_robin`` / ``random``
    Cache-blind baselines (the rotation is per router process).

A request may pin a worker id; it then goes to that worker if it is alive in the pool.

Admission: with ``max_requests`` > 0 (the API's, ``CONVEYOR_WORKER_MAX_REQUESTS``) the
commit also refuses a worker that already counts that many requests (running and queued,
routed by any API replica), so the cap holds cluster-wide; when every live worker of the
pool is at it, :meth:`Router.pick` raises :class:`WorkersBusy` and the API decides whether
to wait (:mod:`api.admission`). Accepted work moving on is never refused: routers that
re-route it (a worker redoing a prefill) keep no cap, and a migrated stream's pick says
``RouteRequest.admitted``. A request of ``n`` choices holds ``n`` sequences on its
worker and counts as ``n`` requests (``RouteRequest.choices``; one more than the cap
allows still goes to a worker that holds none); each choice gives its one back as it
ends.

Load is counted in the cluster's ledger (:mod:`cluster.ledger`): requests, prompt tokens
not yet prefilled, and decode blocks per worker. A request counts
as prefill work until its first token, then the API moves it to decode blocks; it gives
everything back when it ends. This router's counts are kept under its lease, so that when
an API process dies with requests counted the other routers give them back
(:data:`cluster.ledger.RECLAIM_LUA`). Liveness and the prune of dead workers are
:mod:`cluster.membership`'s; the KV index's store and stream :mod:`cluster.index`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from cluster.index import IndexFollower, decision_args
from cluster.ledger import COUNTED, DEAD, FULL, GUARDED, Ledger
from cluster.membership import Membership
from cluster.queues import worker_queue
from tasks.settings import EngineSettings, RouterSettings, Settings

log = logging.getLogger(__name__)

MODES = ("kv", "round_robin", "random")
_NO_LOAD = (0, 0)
MAX_CONFLICTS = 3  # candidates refused by the commit before the least loaded is taken


@dataclass(slots=True)
class RouteRequest:
    """What the router needs to know of a request."""

    block_hashes: list[int]  # of the prompt's full blocks
    prompt_len: int
    pin: str | None = None  # a worker id the request must run on
    # P/D: the worker id its prefill stage must run on (Dynamo's prefill_worker_id)
    prefill_pin: str | None = None
    exclude: set[str] = field(default_factory=set)  # worker ids it must not run on
    images: int = 0  # images in the prompt (an encode stage runs only for those)
    # accepted work moving on (a migrated stream): no request cap applies to it
    admitted: bool = False
    # its choices (n): it holds as many sequences, and counts as as many requests
    choices: int = 1


_AREA = RouterSettings()  # the router settings' defaults, written once in tasks/settings.py


@dataclass(slots=True)
class RouterConfig:
    """The router area (``Settings.router``, whose fields say what each means) plus what
    the router takes from other areas; built by :meth:`from_settings`."""

    mode: str = _AREA.mode
    kv_events: bool = _AREA.kv_events
    approx_ttl_s: float = _AREA.approx_ttl_s
    overlap_weight: float = _AREA.overlap_weight
    temperature: float = _AREA.temperature
    guard_ratio: float = _AREA.guard_ratio
    guard_min_blocks: int = _AREA.guard_min_blocks
    block_size: int = EngineSettings().block_size
    # a cached block in G1/G2/G3
    tier_weights: tuple[float, float, float] = (_AREA.g1_weight, _AREA.g2_weight,
                                                _AREA.g3_weight)  # fmt: skip
    refresh_s: float = 0.1  # how often a router re-reads the pools' live workers and load
    prune_s: float = 1.0  # how often it forgets workers whose heartbeat lapsed
    max_requests: int = 0  # requests (running + queued) one worker may hold; 0: no cap
    # a router's lease on the load it counted, renewed every prune: an API process gone
    # this long has its counts given back by the others (a stalled loop is not that long)
    lease_s: float = _AREA.lease_s

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; known: {list(MODES)}")
        if self.lease_s < 2 * self.prune_s:
            raise ValueError(f"lease_s ({self.lease_s}) must be at least 2 x prune_s "
                             f"({self.prune_s}): the lease is renewed once per prune")  # fmt: skip

    @classmethod
    def from_settings(cls, s: Settings) -> RouterConfig:
        return cls(
            mode=s.router.mode,
            kv_events=s.router.kv_events,
            approx_ttl_s=s.router.approx_ttl_s,
            overlap_weight=s.router.overlap_weight,
            temperature=s.router.temperature,
            guard_ratio=s.router.guard_ratio,
            guard_min_blocks=s.router.guard_min_blocks,
            block_size=s.engine.block_size,
            tier_weights=(s.router.g1_weight, s.router.g2_weight, s.router.g3_weight),
            prune_s=min(1.0, s.worker.heartbeat_s),
            lease_s=s.router.lease_s,
        )


@dataclass(slots=True)
class Route:
    pool: str
    worker_id: str
    reason: str = ""  # kv | kv_guarded | round_robin | random | pinned
    overlap_blocks: int = 0  # leading prompt blocks the chosen worker holds
    best_overlap_blocks: int = 0  # the most any live worker holds (kv mode)
    blocks: int = 0  # decode load once the first token is out, until released
    prefill_tokens: int = 0  # prefill load until the first token (or release)
    decoding: bool = False  # the blocks count (the first token arrived)
    # requests counted (a request's choices, n): each release gives one back, the last
    # one the blocks and prefill tokens too (a choice ends, or moves on, alone)
    reqs: int = 1

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


class PinnedWorkerMissing(Exception):
    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id


class WorkersBusy(Exception):
    """Every live worker of ``pool`` (or the pinned one) holds ``max_requests`` already."""

    def __init__(self, pool: str, cap: int, workers: int) -> None:
        super().__init__(f"all {workers} live workers of pool {pool!r} hold {cap} requests")
        self.pool = pool
        self.cap = cap
        self.workers = workers


@dataclass
class PoolView:
    """What one router knows of one pool: its live workers, their counted load, and the
    local KV index."""

    pool: str
    live: list[str] = field(default_factory=list)
    loads: dict[str, list[int]] = field(default_factory=dict)  # worker -> [blocks, prefill]
    # prefill tokens of this router's picks whose commit is on its way: the picks made
    # meanwhile (requests arriving together) see them, rather than all taking one worker
    pending: dict[str, int] = field(default_factory=dict)
    reqs: dict[str, int] = field(default_factory=dict)  # worker -> requests counted on it
    refreshed: float = -math.inf
    pruned: float = -math.inf
    follower: IndexFollower | None = None
    rr: int = 0
    conflicts: int = 0  # candidates the commit refused (died, or past the guard)
    leases_reclaimed: int = 0  # routers (API processes) gone whose counts this one gave back
    requests_reclaimed: int = 0  # ... and the requests they had counted
    task: asyncio.Task[None] | None = None


class Router:
    """Routes in-process for one API process (see the module's docstring).

    ``fast``, if given, runs the ledger's scripts (the commit, and the load given back at
    the first token and at the end): see :class:`cluster.ledger.Ledger`.
    ``follow=False``: no local index and no background refresh (a worker redoing a
    prefill): overlaps count as 0 and the view is read when it is older than
    ``refresh_s``. ``on_decision(pool, seconds)`` hears how long each pick took;
    ``on_release()`` that this router gave a request's load back (a slot may be free)."""

    def __init__(
        self,
        client: aioredis.Redis,
        config: RouterConfig | None = None,
        fast: Any = None,
        follow: bool = True,
        on_decision: Callable[[str, float], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._r = client
        self._on_release = on_release
        # who counts this router's load, so others can give it back if this process dies
        # (the ledger's reclaim); a router that does not follow holds a count for moments
        self.id = uuid.uuid4().hex[:16] if follow else None
        self.config = config or RouterConfig()
        self._follow = follow
        self._on_decision = on_decision
        self.ledger = Ledger(client, self.id, fast)
        self.membership = Membership(client)
        self._views: dict[str, PoolView] = {}
        self._starting: dict[str, asyncio.Task[PoolView]] = {}

    async def start(self, *pools: str) -> Router:
        """Load the pools' views and indexes now rather than at their first pick."""
        for pool in pools:
            await self.view(pool)
        return self

    async def aclose(self) -> None:
        for v in self._views.values():
            if v.task is not None:
                v.task.cancel()
            if v.follower is not None:
                await v.follower.aclose()
        self._views.clear()

    # ----------------------------------------------------------------------------------
    async def pick(self, pool: str, req: RouteRequest | None = None) -> Route | None:
        """The best live worker of ``pool`` for ``req``, already counted; ``None`` if no
        worker lives. Raises :class:`PinnedWorkerMissing` when the pinned worker is not a
        live member of ``pool``, :class:`WorkersBusy` when every candidate is at the
        request cap."""
        t0 = time.perf_counter()
        req = req or RouteRequest([], 1)
        v = await self.view(pool)
        if not self._follow and time.monotonic() - v.refreshed > self.config.refresh_s:
            await self._refresh(v)
        try:
            if req.pin:
                return await self._pick_pinned(v, req)
            return await self._pick(v, req)
        finally:
            if self._on_decision is not None:
                self._on_decision(pool, time.perf_counter() - t0)

    async def _pick_pinned(self, v: PoolView, req: RouteRequest) -> Route:
        assert req.pin is not None
        if req.pin not in v.live:
            await self._refresh(v)  # it may have joined since the last refresh
        if req.pin not in v.live:
            raise PinnedWorkerMissing(req.pin)
        ov = self._overlaps(v, [req.pin], req.block_hashes).get(req.pin, 0)
        route, status = await self._try(v, req.pin, req, None, overlap=ov)
        if status == FULL:
            raise WorkersBusy(v.pool, self.config.max_requests, 1)
        if route is None:
            raise PinnedWorkerMissing(req.pin)
        route.reason = "pinned"
        return route

    async def _pick(self, v: PoolView, req: RouteRequest) -> Route | None:
        c = self.config
        ids = [w for w in v.live if w not in req.exclude]
        if not ids:
            await self._refresh(v)
            ids = [w for w in v.live if w not in req.exclude]
            if not ids:
                return None
        cap = self._cap(req)
        if cap:  # as far as this router knows; the commit has the last word
            room = [w for w in ids if not self._full(v, w, cap, req.choices)]
            if not room:
                raise WorkersBusy(v.pool, cap, len(ids))
            ids = room
        load = self._loads(v)  # once per pick: O(workers)
        least = min(load.values(), default=0)
        limit = max(c.guard_ratio * sum(load.values()) / max(len(load), 1),
                    least + c.guard_min_blocks)  # fmt: skip
        ov: dict[str, int]  # worker -> blocks of the prompt it holds
        if c.mode == "round_robin":
            start = v.rr % len(ids)
            v.rr += 1
            order, ov, guard, best = ids[start:] + ids[:start], {}, False, 0
        elif c.mode == "random":
            order, ov, guard, best = random.sample(ids, len(ids)), {}, False, 0
        else:
            tov = self._tier_overlaps(v, ids, req.block_hashes)
            ov = {w: t[2] for w, t in tov.items()}
            order = self._rank(v, ids, tov, req, load, limit)
            best, guard = max(ov.values()), True
        for w in order[:MAX_CONFLICTS]:
            route, _ = await self._try(v, w, req, limit if guard else None, ov.get(w, 0))
            if route is not None:
                break
        else:  # refused again and again: the least loaded takes it, guard or not
            alive = [w for w in ids if w in v.live and not self._full(v, w, cap, req.choices)]
            if not alive and cap and any(self._full(v, w, cap, req.choices) for w in ids):
                raise WorkersBusy(v.pool, cap, len(ids))
            w = min(alive or ids, key=lambda w: self._load(v, w))
            route, status = await self._try(v, w, req, None, ov.get(w, 0))
            if status == FULL:
                raise WorkersBusy(v.pool, cap, len(ids))
            if route is None:
                await self._refresh(v)
                return None
        route.best_overlap_blocks = best
        route.reason = c.mode
        if (
            c.mode == "kv"
            and route.overlap_blocks < best
            and any(ov[w] > route.overlap_blocks and load.get(w, 0) > limit for w in ids)
        ):
            route.reason = "kv_guarded"
        return route

    def _rank(self, v: PoolView, ids: list[str], tov: dict[str, tuple[int, int, int]],
              req: RouteRequest, load: dict[str, int], limit: float) -> list[str]:  # fmt: skip
        """Candidates in the order to try them: within the load guard, by cost (or drawn by
        the softmax over costs with a temperature); the guarded ones last."""
        c, bs = self.config, self.config.block_size
        w1, w2, w3 = c.tier_weights
        ow = c.overlap_weight
        nblocks = -(-max(req.prompt_len, 1) // bs)
        costs = {}
        inside: list[str] = []
        outside: list[str] = []
        loads = v.loads
        # ow x (blocks to prefill), per distinct overlap: most workers share one (a prefix
        # held everywhere, or nowhere)
        to_prefill: dict[tuple[int, int, int], float] = {}
        for w in ids:
            t = tov[w]
            p = to_prefill.get(t)
            if p is None:
                n1, n12, n = t
                saved = w1 * n1 + w2 * (n12 - n1) + w3 * (n - n12)  # cached blocks, by tier
                p = to_prefill[t] = ow * (nblocks - saved)
            b = loads.get(w, _NO_LOAD)[0]
            lw = load.get(w, b)  # b + the prefill queued on w (pending picks too), in blocks
            costs[w] = p + ow * (lw - b) + b
            (inside if lw <= limit else outside).append(w)
        outside.sort(key=lambda w: load.get(w, 0))
        if c.temperature <= 0:
            inside.sort(key=costs.__getitem__)
            _shuffle_ties(inside, costs, MAX_CONFLICTS)  # ties broken at random
        else:
            cmin = min(costs[w] for w in inside)
            span = max(max(costs[w] for w in inside) - cmin, 1)
            weights = [math.exp(-((costs[w] - cmin) / span) / c.temperature) for w in inside]
            drawn = []
            while inside:  # a draw without replacement: the first is the softmax pick
                i = random.choices(range(len(inside)), weights)[0]
                drawn.append(inside.pop(i))
                weights.pop(i)
            inside = drawn
        return inside + outside

    def _cap(self, req: RouteRequest) -> int:
        """The requests a worker may hold for ``req``'s pick; 0: no cap (accepted work)."""
        return 0 if req.admitted else self.config.max_requests

    def _full(self, v: PoolView, w: str, cap: int, choices: int = 1) -> bool:
        """Whether ``w`` has no room for a request of ``choices`` (COMMIT_LUA's rule)."""
        n = v.reqs.get(w, 0)
        return bool(cap) and n > 0 and n + choices > cap

    def _load(self, v: PoolView, w: str) -> int:
        b, q = v.loads.get(w, (0, 0))
        return b + -(-(q + v.pending.get(w, 0)) // self.config.block_size)

    def _loads(self, v: PoolView) -> dict[str, int]:
        """:meth:`_load` of every live worker (the pick's hot loop, inlined)."""
        bs, loads, pending = self.config.block_size, v.loads, v.pending
        out = {}
        for w in v.live:
            b, q = loads.get(w, (0, 0))
            out[w] = b + -(-(q + pending.get(w, 0)) // bs) if pending else b + -(-q // bs)
        return out

    def _overlaps(self, v: PoolView, ids: list[str], hashes: list[int]) -> dict[str, int]:
        if v.follower is None or not hashes:
            return dict.fromkeys(ids, 0)
        return v.follower.index.overlaps(ids, hashes, approx=not self.config.kv_events)

    def _tier_overlaps(self, v: PoolView, ids: list[str],
                       hashes: list[int]) -> dict[str, tuple[int, int, int]]:  # fmt: skip
        """Per worker, its prefix blocks held in G1, in G1 or G2, in any tier."""
        if v.follower is None or not hashes:
            return dict.fromkeys(ids, (0, 0, 0))
        if not self.config.kv_events:  # approximate: the router's decisions stand for G1
            return {w: (n, n, n) for w, n in self._overlaps(v, ids, hashes).items()}
        return v.follower.index.tier_overlaps(ids, hashes)

    async def _try(self, v: PoolView, w: str, req: RouteRequest, limit: float | None,
                   overlap: int) -> tuple[Route | None, int]:  # fmt: skip
        """Commit the request to ``w`` (``limit``: the load guard's, as this router sees
        the pool; ``None``: no guard): the route and the commit's status, or ``None`` and
        why it refused (DEAD, GUARDED, FULL)."""
        c, bs = self.config, self.config.block_size
        nblocks = -(-max(req.prompt_len, 1) // bs)
        add_prefill = max(req.prompt_len - overlap * bs, 1)
        approx = c.mode == "kv" and not c.kv_events and bool(req.block_hashes)
        decision = decision_args(v.pool, req.block_hashes, c.approx_ttl_s) if approx else None
        v.pending[w] = v.pending.get(w, 0) + add_prefill
        v.reqs[w] = v.reqs.get(w, 0) + req.choices  # the picks made meanwhile see it
        try:
            res = await self.ledger.commit(
                v.pool, w, add_prefill, cap=self._cap(req), choices=req.choices,
                limit=limit, block_size=bs, decision=decision,
            )  # fmt: skip
        except BaseException:
            v.reqs[w] = max(v.reqs.get(w, req.choices) - req.choices, 0)
            raise
        finally:
            left = v.pending[w] - add_prefill
            if left:
                v.pending[w] = left
            else:
                del v.pending[w]
        status = res.status
        if status == DEAD:
            v.conflicts += 1
            v.reqs.pop(w, None)
            if w in v.live:
                v.live.remove(w)  # dead: the next refresh confirms it
            return None, status
        v.loads[w] = [res.blocks, res.prefill]
        v.reqs[w] = res.reqs
        if status != COUNTED:
            v.conflicts += status == GUARDED  # at the cap is admission, not a conflict
            return None, status
        if approx and v.follower is not None:
            v.follower.index.remember(w, req.block_hashes, time.monotonic() + c.approx_ttl_s)
        # the prompt's blocks once, a block to decode into per choice
        return Route(v.pool, w, overlap_blocks=overlap, blocks=nblocks + req.choices,
                     prefill_tokens=add_prefill, reqs=req.choices), status  # fmt: skip

    # ----------------------------------------------------------------------------------
    async def view(self, pool: str) -> PoolView:
        """``pool``'s view, started on first use (one start even for callers at once)."""
        v = self._views.get(pool)
        if v is not None:
            return v
        task = self._starting.get(pool)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._start_view(pool))
            self._starting[pool] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._starting.pop(pool, None)

    async def _start_view(self, pool: str) -> PoolView:
        v = PoolView(pool)
        await self._refresh(v)
        if self._follow:
            v.follower = await IndexFollower(
                self._r, pool, approx_ttl_s=0.0 if self.config.kv_events else
                self.config.approx_ttl_s
            ).start()  # fmt: skip
            v.task = asyncio.get_running_loop().create_task(self._keep(v), name=f"view-{pool}")
        self._views[pool] = v
        return v

    async def _keep(self, v: PoolView) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self._refresh(v)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis away: the view ages meanwhile
                log.warning("router: refreshing pool %s failed: %s", v.pool, e)

    async def _refresh(self, v: PoolView) -> None:
        now = time.monotonic()
        if now - v.pruned >= self.config.prune_s:
            v.pruned = now
            gone = await self.membership.prune(v.pool)
            if gone:
                log.info("router: forgot dead workers of %s: %s", v.pool, ", ".join(gone))
            if self.id is not None:  # once per prune: renew the lease, reclaim lapsed ones
                n, owners = await self.ledger.reclaim(v.pool, self.config.lease_s)
                if owners:
                    v.leases_reclaimed += len(owners)
                    v.requests_reclaimed += n
                    log.warning("router: gave back %d requests counted on %s by routers whose "
                                "lease lapsed (%.0f s; their API process died?): %s",
                                n, v.pool, self.config.lease_s, ", ".join(owners))  # fmt: skip
        view = await self.ledger.view(v.pool)
        v.live, v.loads, v.reqs, v.refreshed = view.live, view.loads, view.reqs, now
        if v.follower is not None:  # the dead leave the local index
            for w in v.follower.index.workers - set(view.live):
                v.follower.index.drop(w)

    # ----------------------------------------------------------------------------------
    async def prefilled(self, route: Route) -> None:
        """The route's prompt is prefilled: its tokens no longer queue on the worker; its
        blocks count as decode load from now on."""
        if route.decoding:
            return
        route.decoding = True
        n, route.prefill_tokens = route.prefill_tokens, 0
        w = route.worker_id
        await self.ledger.give_back(
            self.ledger.give_back_call(route.pool, w, {"prefill": n, "blocks": -route.blocks})
        )
        self._count(route.pool, w, route.blocks, -n)

    async def release(self, *routes: Route, before: tuple[tuple, ...] = (),
                      one: bool = False) -> None:  # fmt: skip
        """The request routed by ``routes`` is over: stop counting it. ``before``: commands
        to run first, in the same round trip (the caller's own clean-up). ``one``: one of
        the request's choices is over (a route counts each, ``Route.reqs``): give back one
        request, and the blocks and prefill tokens with the last."""
        calls, parts = [], []
        for route in routes:
            w = route.worker_id
            n = min(1, route.reqs) if one else route.reqs
            route.reqs -= n
            last = route.reqs <= 0
            blocks = route.blocks if route.decoding and last else 0
            prefill = route.prefill_tokens if last else 0
            parts.append((route, n, blocks, prefill))
            calls.append(self.ledger.give_back_call(
                route.pool, w, {"reqs": n, "blocks": blocks, "prefill": prefill}))  # fmt: skip
        try:
            await self.ledger.give_back(*calls, before=before)
        finally:
            if self._on_release is not None and routes:
                self._on_release()
        for route, n, blocks, prefill in parts:
            self._count(route.pool, route.worker_id, -blocks, -prefill, -n)
            if route.reqs <= 0:
                route.prefill_tokens = 0
                route.decoding = False

    def _count(self, pool: str, w: str, blocks: int, prefill: int, reqs: int = 0) -> None:
        """This router's own change to a worker's load, seen before the next refresh."""
        v = self._views.get(pool)
        if v is not None and w in v.loads:
            b, q = v.loads[w]
            v.loads[w] = [max(b + blocks, 0), max(q + prefill, 0)]
            if w in v.reqs:
                v.reqs[w] = max(v.reqs[w] + reqs, 0)

    # ----------------------------------------------------------------------------------
    async def all_live(self, routes: Iterable[Route]) -> bool:
        """Whether every routed worker is still live (one round trip)."""
        return await self.membership.all_live((r.pool, r.worker_id) for r in routes)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per pool: the local index's size and lag, snapshot loads, commit conflicts."""
        out = {}
        for pool, v in self._views.items():
            f = v.follower
            out[pool] = {
                "index_blocks": f.index.num_blocks if f else 0,
                "index_workers": len(f.index.workers) if f else 0,
                "event_lag_seconds": f.stats.lag_s if f else 0.0,
                "events_applied": f.stats.entries if f else 0,
                "snapshot_loads": f.stats.snapshot_loads if f else 0,
                "worker_reloads": f.stats.worker_reloads if f else 0,
                "commit_conflicts": v.conflicts,
                "leases_reclaimed": v.leases_reclaimed,
                "requests_reclaimed": v.requests_reclaimed,
                "live_workers": len(v.live),
            }
        return out


def _shuffle_ties(order: list[str], costs: dict[str, float], k: int) -> None:
    """Shuffle, in place, the runs of equal cost among the first ``k`` of ``order``
    (sorted by cost) and the run the k-th belongs to: only those are tried, so the rest
    may keep its order (a shuffle of every candidate cost a fifth of a pick)."""
    n = len(order)
    i = 0
    while i < min(k, n):
        j, c = i + 1, costs[order[i]]
        while j < n and costs[order[j]] == c:
            j += 1
        if j - i > 1:
            run = order[i:j]
            random.shuffle(run)
            order[i:j] = run
        i = j
