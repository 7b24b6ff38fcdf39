"""The planner's two loops, per pool, and the run loop that feeds them.

**Load loop** (every ``load_interval_s``, ~5 s). For every live worker of a pool it
estimates what a request sent now would see there: TTFT behind the worker's waiting
requests and its share of the pool's queue, from the pool's fitted step model
(:class:`planner.model.StepModel`), and ITL as the 90th percentile of its last steps'
wall times. It adds one worker when *every* worker is over a target, and removes one when
*every* worker is under ``sensitivity`` x each target and the pool one smaller still meets
the targets at the observed rate, or when the pool is idle (no request in the window,
nothing running). Before the model has a fit it goes by the API's observed TTFT/ITL
quantiles instead.

**Throughput loop** (every ``throughput_interval_s``, ~180 s). It forecasts the next
interval's request rate, prompt and output lengths (:mod:`planner.forecast`) and sizes
the pool from the model's per-worker capacity at the targets (TTFT with a margin): that
number is a floor the load loop does not go below, and the pool is raised to it at once.
While traffic has just begun (the API's window has not seen it for a whole window) the
floor is sized on every tick from the rate since it began, for as long as that lasts.

**Calibration.** The model's TTFT and ITL quantiles are corrected by the API's observed
ones (:meth:`planner.model.StepModel.calibrate`) whenever the API's window saw the pool
at one size, so the pool the model sizes is the one that meets the targets.

Every decision is clamped to ``min_workers``..``max_workers`` and to the GPU budget, and
goes to the connector. After an action the pool is held (no further action) until the
connector says it took effect and the pool's live workers number what was asked, or
``hold_timeout_s`` passes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis

from cluster.keys import planner_state_key
from planner.connectors import Connector, ConnectorError, Decision
from planner.forecast import Forecaster, make_forecaster
from planner.inputs import Observation, PoolView, TrafficView, WorkerView, observe
from planner.model import Load, StepModel

log = logging.getLogger("conveyor.planner")

# the work each pool does: (computes prompts, decodes)
ROLES: dict[str, tuple[bool, bool]] = {
    "generate": (True, True),
    "prefill": (True, False),
    "decode": (False, True),
}
DEFAULT_ISL, DEFAULT_OSL = 512.0, 128.0  # request shape assumed before any traffic
DOWN_AFTER_UP = 6  # load intervals after growing before the pool may shrink (no flapping)
MIN_OBSERVED = 8  # requests in the window before the observed quantiles count (no model yet)
QUEUED_PER_ENCODER = 2.0  # encode pools (no step model): more queued per worker -> grow


@dataclass(slots=True)
class PlannerConfig:
    pools: tuple[str, ...] = ("generate",)
    ttft_target_s: float = 1.0  # at the quantile below
    itl_target_s: float = 0.05
    quantile: float = 0.9
    load_interval_s: float = 5.0
    throughput_interval_s: float = 180.0
    window_s: float = 30.0  # the API traffic window each tick reads
    min_workers: int = 1
    max_workers: int = 8
    gpu_budget: int = 8  # GPUs all pools together may hold
    gpus_per_worker: dict[str, int] = field(default_factory=dict)  # pool -> GPUs (default 1)
    sensitivity: float = 0.7  # scale down only when every worker is under target x this
    forecaster: str = "kalman"
    hold_timeout_s: float = 300.0
    load_loop: bool = True
    throughput_loop: bool = True

    def gpus(self, pool: str) -> int:
        return self.gpus_per_worker.get(pool, 1)


@dataclass(slots=True)
class WorkerEstimate:
    worker_id: str
    ttft: float | None
    itl: float | None


@dataclass(slots=True)
class PoolPlan:
    """One pool's model and the planner's view of it."""

    pool: str
    model: StepModel = field(default_factory=StepModel)  # the planner sets its quantile
    has: int = 0  # live workers at the last observation
    wanted: int = 0  # the last number asked for (or has, before any action)
    floor: int = 0  # the throughput loop's prediction (the one in force)
    forecast_floor: int = 0  # its last prediction from a forecast (not a cold start's)
    hold: Decision | None = None
    hold_since: float = 0.0
    estimates: list[WorkerEstimate] = field(default_factory=list)
    worker_seconds: float = 0.0
    last_ts: float | None = None
    decisions: dict[str, int] = field(default_factory=dict)  # "load-up" etc. -> count
    clamped: bool = False  # the last wish to grow was refused by the bounds
    last_up: float = float("-inf")  # when the pool was last grown
    last_change: float = float("-inf")  # when the pool was last asked to change size

    def estimated(self, which: str) -> float | None:
        vals = [getattr(e, which) for e in self.estimates if getattr(e, which) is not None]
        return float(np.mean(vals)) if vals else None


class Planner:
    def __init__(self, cfg: PlannerConfig, connector: Connector,
                 client: redis.Redis | None = None, dry_run: bool = False,
                 record: Callable[[Observation], None] | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.connector = connector
        self.client = client
        self.dry_run = dry_run  # an action takes effect by the next observation
        self.record = record
        self.plans = {p: PoolPlan(p, StepModel(quantile=cfg.quantile)) for p in cfg.pools}
        self.forecast: dict[str, Forecaster] = {
            k: make_forecaster(cfg.forecaster) for k in ("rate", "isl", "osl")
        }
        self.predicted: dict[str, float | None] = {"rate": None, "isl": None, "osl": None}
        self.traffic = TrafficView()
        self.isl, self.osl = DEFAULT_ISL, DEFAULT_OSL  # until traffic says otherwise
        self._tp_acc: list[TrafficView] = []  # readings since the last throughput tick
        self._last_load: float | None = None
        self._last_tp: float | None = None
        self._traffic_since: float | None = None  # when the API's window last began to see any

    # ----------------------------------------------------------------------------------
    # The run loop
    # ----------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Observe, decide, publish, every ``load_interval_s``, until ``stop`` is set."""
        assert self.client is not None, "a live planner reads Redis"
        log.info("planner: pools %s, targets TTFT p%d %.0f ms, ITL %.0f ms, connector %s",
                 ",".join(self.cfg.pools), round(self.cfg.quantile * 100),
                 self.cfg.ttft_target_s * 1000, self.cfg.itl_target_s * 1000,
                 self.connector.name)  # fmt: skip
        while not stop.is_set():
            try:
                obs = observe(self.client, self.cfg.pools, self.cfg.window_s, self.cfg.quantile)
                if self.record is not None:
                    self.record(obs)
                self.step(obs)
                self.publish()
            except redis.RedisError as e:  # Redis restarting: try again next tick
                log.warning("planner: cannot read the cluster (%s)", e)
            stop.wait(self.cfg.load_interval_s)

    def step(self, obs: Observation) -> list[Decision]:
        """One tick on one observation: feed the models, release settled holds, run the
        loops that are due. Returns the decisions made."""
        now = obs.ts
        self.traffic = obs.traffic
        if obs.traffic.requests and obs.traffic.isl:  # lengths: the last window that had any
            self.isl = obs.traffic.isl
        if obs.traffic.finished and obs.traffic.osl:
            self.osl = obs.traffic.osl
        self._tp_acc.append(obs.traffic)
        if not obs.traffic.requests:
            self._traffic_since = None
        elif self._traffic_since is None:
            self._traffic_since = now
        # traffic has just begun: the API's window has not yet seen it for a whole window
        cold = self._traffic_since is not None and now - self._traffic_since <= self.cfg.window_s
        if not cold:  # a floor sized while cold lasts only as long (the forecast's holds)
            for plan in self.plans.values():
                plan.floor = plan.forecast_floor
        for name, plan in self.plans.items():
            view = obs.pools.get(name, PoolView(name))
            self._absorb(plan, view, now)
            if not cold:  # a cold window's quantiles lag its queue: no ratio to take
                self._calibrate(plan, obs.traffic, now)
        out: list[Decision] = []
        fitted = any(p.model.coef is not None for p in self.plans.values())
        if self.cfg.throughput_loop and fitted:
            if self._last_tp is None or now - self._last_tp >= self.cfg.throughput_interval_s:
                self._last_tp = now  # its first tick: once a model fits
                out += self._throughput_tick(obs)
            elif cold and self._traffic_since is not None:
                # size the floor on each tick from the rate since the traffic began (over
                # the whole window it reads low): a cold pool would otherwise wait a
                # throughput interval, its queue growing, for the next tick
                seen = now - self._traffic_since + self.cfg.load_interval_s / 2
                rate = obs.traffic.requests / max(self.cfg.load_interval_s, seen)
                out += self._size_floors(obs, rate, self.isl, self.osl, cold=True)
        if self.cfg.load_loop and (
            self._last_load is None or now - self._last_load >= self.cfg.load_interval_s * 0.9
        ):
            self._last_load = now
            for name, plan in self.plans.items():
                d = self._load_tick(plan, obs.pools.get(name, PoolView(name)), obs.traffic, now)
                if d is not None:
                    out.append(d)
        return out

    # ----------------------------------------------------------------------------------
    def _absorb(self, plan: PoolPlan, view: PoolView, now: float) -> None:
        if plan.last_ts is not None:
            plan.worker_seconds += plan.has * max(0.0, now - plan.last_ts)
        plan.last_ts = now
        plan.has = len(view.workers)
        if plan.hold is None:
            plan.wanted = plan.has
        fresh = {w.worker_id: plan.model.add(w.worker_id, w.samples) for w in view.workers}
        plan.model.forget(set(fresh))
        plan.model.fit()
        plan.estimates = [self._estimate(plan, w, fresh[w.worker_id], view)
                          for w in view.workers]  # fmt: skip
        if plan.hold is not None:
            self._check_hold(plan, now)

    def _calibrate(self, plan: PoolPlan, traffic: TrafficView, now: float) -> None:
        """Correct the pool model's quantiles by the API's observed ones, when the window
        the API's figures cover saw this pool at one size and enough requests: TTFT for a
        pool that computes prompts, ITL for one that decodes."""
        prefill, decode = ROLES.get(plan.pool, (False, False))
        if (
            plan.model.coef is None
            or plan.hold is not None
            or not plan.has
            or traffic.requests < MIN_OBSERVED
            or now - plan.last_change < max(traffic.window_s, self.cfg.window_s)
        ):
            return
        load = Load(traffic.rate, self.isl, self.osl)
        plan.model.calibrate(load, plan.has, prefill, decode,
                             traffic.ttft if prefill else None,
                             traffic.itl if decode else None)  # fmt: skip

    def _check_hold(self, plan: PoolPlan, now: float) -> None:
        d = plan.hold
        assert d is not None
        try:
            settled = self.dry_run or (self.connector.settled(d) and plan.has == d.replicas)
        except ConnectorError as e:
            log.warning("planner: %s: cannot tell whether %s took effect (%s)", plan.pool, d.id, e)
            settled = False
        if settled:
            log.info("planner: %s: %d workers as asked (%s)", plan.pool, d.replicas, d.id[:8])
            plan.hold = None
        elif now - plan.hold_since >= self.cfg.hold_timeout_s:
            log.warning("planner: %s: asked for %d workers %.0f s ago and has %d: acting again",
                        plan.pool, d.replicas, now - plan.hold_since, plan.has)  # fmt: skip
            plan.hold = None

    def _estimate(self, plan: PoolPlan, w: WorkerView, fresh: list[list[float]],
                  view: PoolView) -> WorkerEstimate:  # fmt: skip
        """What a request sent to ``w`` now would see (``None``: no model yet). ITL: the
        quantile of the steps it ran since the last tick (``fresh``), else the model's
        step at its batch (an idle worker's step is the bare one)."""
        prefill, decode = ROLES.get(plan.pool, (False, False))
        isl = self.isl
        kv = fresh[-1][4] if fresh else (w.kv_tokens if w.running else 0.0)  # now, not stale
        share = view.queued / max(1, len(view.workers))  # its part of the pool's queue
        ttft = None
        if prefill:
            ttft = plan.model.ttft((w.waiting + share + 1) * isl, w.running, kv)
        itl = None
        if decode:
            recent = [s[1] for s in fresh if s[3] > 0]
            if recent:  # what its decoding requests see now
                itl = float(np.percentile(recent, self.cfg.quantile * 100))
            else:
                itl = plan.model.itl(w.running, kv)
        return WorkerEstimate(w.worker_id, ttft, itl)

    # ----------------------------------------------------------------------------------
    # The load loop
    # ----------------------------------------------------------------------------------
    def _load_tick(self, plan: PoolPlan, view: PoolView, traffic: TrafficView,
                   now: float) -> Decision | None:  # fmt: skip
        if plan.hold is not None or not view.workers:
            return None
        if plan.pool not in ROLES:  # encode: by its queue alone
            per = view.queued / len(view.workers)
            idle = _idle(view)
            if per > QUEUED_PER_ENCODER:
                why = f"load: {view.queued} queued for {plan.has} encoders"
                return self._act(plan, plan.has + 1, "load-up", why, now)
            if idle:
                return self._act(plan, plan.has - 1, "load-down", "load: encoders idle", now)
            return None
        t_ttft, t_itl = self.cfg.ttft_target_s, self.cfg.itl_target_s
        ests = plan.estimates
        have_model = plan.model.coef is not None
        if have_model:
            settled = now - plan.last_up >= DOWN_AFTER_UP * self.cfg.load_interval_s
            if traffic.requests == 0 and _idle(view):
                # nothing came for a whole window and nothing runs: what a request would
                # see does not depend on the pool's size, whatever the estimates say
                if not settled:
                    return None
                return self._act(plan, plan.has - 1, "load-down",
                                 "load: idle (no request in the window)", now)  # fmt: skip
            over = [e for e in ests if (e.ttft or 0) > t_ttft or (e.itl or 0) > t_itl]
            if len(over) == len(ests):
                worst = max(ests, key=lambda e: max((e.ttft or 0) / t_ttft, (e.itl or 0) / t_itl))
                return self._act(plan, plan.has + 1, "load-up",
                                 f"load: all {len(ests)} over target (best est TTFT "
                                 f"{_ms(min(e.ttft or 0 for e in ests))}, ITL "
                                 f"{_ms(min(e.itl or 0 for e in ests))}; worst "
                                 f"{worst.worker_id})", now)  # fmt: skip
            # down: every worker well under (TTFT under sensitivity x target; ITL, whose
            # quantile a prompt chunk's step sets whatever the pool's size, within it),
            # nothing queued, and the model's steady state for one worker fewer well
            # within both targets
            s = self.cfg.sensitivity
            under = [e for e in ests if (e.ttft or 0) < t_ttft * s and (e.itl or 0) <= t_itl]
            if (len(under) == len(ests) and view.queued == 0 and settled
                    and self._fits_smaller(plan)):  # fmt: skip
                return self._act(plan, plan.has - 1, "load-down",
                                 f"load: all {len(ests)} under target (est TTFT "
                                 f"{_ms(plan.estimated('ttft'))} < {s:g} x, ITL "
                                 f"{_ms(plan.estimated('itl'))})", now)  # fmt: skip
            return None
        # no fit yet: the API's observed quantiles stand for every worker, once enough
        # requests have been seen (one cold request is no signal)
        obs_t, obs_i = traffic.ttft, traffic.itl
        if traffic.requests >= MIN_OBSERVED and ((obs_t or 0) > t_ttft or (obs_i or 0) > t_itl):
            return self._act(plan, plan.has + 1, "load-up",
                             f"load (observed, no model yet): TTFT p{self._q} {_ms(obs_t)}, "
                             f"ITL {_ms(obs_i)}", now)  # fmt: skip
        # ...and shrink it while they are well under the targets (or nothing came) and no
        # request waits anywhere; if that was one too few, the next tick grows it again
        s = self.cfg.sensitivity
        calm = view.queued == 0 and all(w.waiting == 0 for w in view.workers)
        idle = _idle(view)
        quiet = (traffic.requests >= MIN_OBSERVED and (obs_t or 0) < t_ttft * s
                 and (obs_i or 0) < t_itl * s)  # fmt: skip
        if plan.has > 1 and calm and (quiet or (idle and traffic.requests == 0)):
            return self._act(plan, plan.has - 1, "load-down",
                             f"load (observed, no model yet): TTFT p{self._q} {_ms(obs_t)}, "
                             f"ITL {_ms(obs_i)}, nothing waiting", now)  # fmt: skip
        return None

    def _fits_smaller(self, plan: PoolPlan) -> bool:
        """Whether one worker fewer still meets the targets at the observed rate (or the
        forecast one, when that is higher: the load may be rising)."""
        n = plan.has - 1
        if n < 1:
            return False
        rate = max(self.traffic.rate, self.predicted.get("rate") or 0.0)
        if rate <= 0:
            return True
        prefill, decode = ROLES[plan.pool]
        s = plan.model.steady(rate, Load(rate, self.isl, self.osl), prefill, decode, n)
        m = self._margin
        return (
            s is not None
            and s[0] <= m * self.cfg.ttft_target_s
            and s[1] <= m * self.cfg.itl_target_s
        )

    @property
    def _margin(self) -> float:
        """The share of the TTFT target a pool is sized to, in steady state: a 10-s
        window's p90 scatters around the steady one, and the pool must not flap between
        the size the floor asks and the one the load loop's scale-down allows."""
        return (1 + self.cfg.sensitivity) / 2

    @property
    def _q(self) -> int:
        return round(self.cfg.quantile * 100)

    # ----------------------------------------------------------------------------------
    # The throughput loop
    # ----------------------------------------------------------------------------------
    def _throughput_tick(self, obs: Observation) -> list[Decision]:
        acc, self._tp_acc = self._tp_acc, []
        rate = float(np.mean([t.rate for t in acc])) if acc else obs.traffic.rate
        done = sum(t.finished for t in acc)
        isl = _weighted([(t.isl, t.requests) for t in acc]) or obs.traffic.isl
        osl = _weighted([(t.osl, t.finished) for t in acc]) or obs.traffic.osl
        self.forecast["rate"].observe(rate)
        if isl:
            self.forecast["isl"].observe(isl)
        if osl and done:
            self.forecast["osl"].observe(osl)
        self.predicted = {k: f.predict() for k, f in self.forecast.items()}
        p_rate, p_isl, p_osl = (self.predicted[k] for k in ("rate", "isl", "osl"))
        # before any request has finished (a cold start) the lengths seen so far, or the
        # defaults, stand for the forecast
        p_isl, p_osl = p_isl or self.isl, p_osl or self.osl
        if p_rate is None:
            return []
        if p_rate > rate:
            # the forecast is the next interval's mean; a rising load is higher at its
            # end, and the floor has to hold until the next tick
            p_rate += (p_rate - rate) / 2
        return self._size_floors(obs, p_rate, p_isl, p_osl, cold=False)

    def _size_floors(self, obs: Observation, p_rate: float, p_isl: float, p_osl: float,
                     cold: bool) -> list[Decision]:  # fmt: skip
        """Each pool's floor for ``p_rate`` requests/s of the given lengths (a forecast's,
        or while ``cold`` the rate since traffic began), and a pool below its floor raised
        to it at once."""
        out = []
        for plan in self.plans.values():
            if plan.pool not in ROLES:
                continue
            prefill, decode = ROLES[plan.pool]
            need = plan.model.workers_for(Load(p_rate, p_isl, p_osl),
                                          self._margin * self.cfg.ttft_target_s,
                                          self.cfg.itl_target_s, prefill, decode,
                                          self.cfg.max_workers)  # fmt: skip
            if need is None:
                continue
            floor = min(self.cfg.max_workers, max(self.cfg.min_workers, need))
            if cold:  # on top of the forecast's floor, for the cold window only
                plan.floor = max(floor, plan.forecast_floor)
            else:
                plan.floor = plan.forecast_floor = floor
            if plan.hold is None and plan.has and plan.floor > plan.has:
                why = (f"throughput: {p_rate:.2f} req/s of ISL {p_isl:.0f} / OSL {p_osl:.0f} "
                       f"{'since traffic began' if cold else 'forecast'} needs {need} "
                       "workers")  # fmt: skip
                d = self._act(plan, plan.floor, "throughput-up", why, obs.ts)
                if d is not None:
                    out.append(d)
        return out

    # ----------------------------------------------------------------------------------
    def _act(self, plan: PoolPlan, want: int, kind: str, reason: str,
             now: float) -> Decision | None:  # fmt: skip
        want = max(want, plan.floor, self.cfg.min_workers)
        want = min(want, self.cfg.max_workers, self._budget_for(plan))
        if kind.endswith("-down") and want >= plan.has:
            return None  # the throughput loop's floor (or min_workers) holds the pool
        if want == plan.has or (kind.endswith("-up") and want < plan.has):
            if kind.endswith("-up"):  # at the bounds: nothing to do but say so (once a run)
                if not plan.clamped:
                    log.warning("planner: %s: would grow but is at its bound (%d workers; max "
                                "%d, GPU budget %d)", plan.pool, plan.has,
                                self.cfg.max_workers, self.cfg.gpu_budget)  # fmt: skip
                plan.clamped = True
                plan.decisions["clamped"] = plan.decisions.get("clamped", 0) + 1
            return None
        plan.clamped = False
        d = Decision(plan.pool, want, plan.has, reason, ts=now)
        try:
            self.connector.scale(d)
        except ConnectorError as e:
            log.error("planner: %s: %d -> %d failed: %s", plan.pool, plan.has, want, e)
            plan.decisions["failed"] = plan.decisions.get("failed", 0) + 1
            return None
        log.info("planner: %s: %d -> %d workers (%s)", plan.pool, plan.has, want, reason)
        plan.wanted, plan.hold, plan.hold_since, plan.last_change = want, d, now, now
        if want > plan.has:
            plan.last_up = now
        plan.decisions[kind] = plan.decisions.get(kind, 0) + 1
        return d

    def _budget_for(self, plan: PoolPlan) -> int:
        """The most workers ``plan``'s pool may have within the GPU budget, the other
        pools keeping what they have (or were asked to have)."""
        others = sum(max(p.has, p.wanted) * self.cfg.gpus(p.pool)
                     for p in self.plans.values() if p is not plan)  # fmt: skip
        return max(0, (self.cfg.gpu_budget - others) // self.cfg.gpus(plan.pool))

    # ----------------------------------------------------------------------------------
    def state(self) -> dict:
        """What ``/metrics`` shows (:mod:`planner.metrics`)."""
        t = self.traffic
        return {
            "ts": time.time(),
            "connector": self.connector.name,
            "targets": {
                "ttft": self.cfg.ttft_target_s,
                "itl": self.cfg.itl_target_s,
                "quantile": self.cfg.quantile,
            },  # fmt: skip
            "observed": {
                "rate": t.rate,
                "isl": t.isl,
                "osl": t.osl,
                "ttft": t.ttft,
                "itl": t.itl,
            },  # fmt: skip
            "forecast": dict(self.predicted),
            "pools": {
                p.pool: {
                    "has": p.has,
                    "wanted": p.wanted,
                    "predicted": p.floor,
                    "held": p.hold is not None,
                    "est_ttft": p.estimated("ttft"),
                    "est_itl": p.estimated("itl"),
                    "worker_seconds": p.worker_seconds,
                    "ttft_scale": p.model.ttft_scale,
                    "itl_scale": p.model.itl_scale,
                    "decisions": dict(p.decisions),
                    "model": None
                    if p.model.coef is None
                    else {
                        "base": p.model.coef.base,
                        "per_prefill_token": p.model.coef.per_prefill_token,
                        "per_seq": p.model.coef.per_seq,
                        "per_kv_token": p.model.coef.per_kv_token,
                        "r2": p.model.r2,
                        "samples": len(p.model.samples),
                    },
                }
                for p in self.plans.values()
            },
        }

    def publish(self) -> None:
        """The state in Redis, for every API replica's ``/metrics``; it expires when the
        planner stops."""
        if self.client is None:
            return
        ttl = max(15, int(self.cfg.load_interval_s * 4))
        self.client.set(planner_state_key(), json.dumps(self.state()), ex=ttl)


def _idle(view: PoolView) -> bool:
    """Nothing queued for the pool and nothing running or waiting on any worker."""
    return view.queued == 0 and all(w.running + w.waiting == 0 for w in view.workers)


def _weighted(pairs: list[tuple[float, int]]) -> float:
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else 0.0


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"
