"""The planner's two loops on observations: built here, and recorded from a real run
(``data/recorded.jsonl``, ``conveyor planner --record`` under ``bench/planner_sim.py``).

What must hold (issue 35): scale up only when every worker is over the SLA, down only
when every one is under SLA x sensitivity; hold while an action takes effect; clamp to
min/max workers and the GPU budget; the throughput loop raises the pool to its floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.connectors import ConnectorError, Decision
from planner.core import Planner, PlannerConfig
from planner.inputs import Observation, PoolView, TrafficView, WorkerView, read_recording
from planner.model import Coefficients, Load

DATA = Path(__file__).parent / "data"
COST = Coefficients(base=0.010, per_prefill_token=40e-6, per_seq=0.2e-3, per_kv_token=0.02e-6)


class FakeConnector:
    name = "fake"

    def __init__(self) -> None:
        self.asked: list[Decision] = []
        self.done = False
        self.fail = False

    def replicas(self, pool: str) -> int | None:
        return None

    def scale(self, decision: Decision) -> None:
        if self.fail:
            raise ConnectorError("the orchestrator said no")
        self.asked.append(decision)

    def settled(self, decision: Decision) -> bool:
        return self.done


class Cluster:
    """Workers whose steps cost ``COST``; each tick reports the steps since the last."""

    def __init__(self, n: int, running: int = 8, waiting: int = 0, ctx: int = 1000) -> None:
        self.step_no = 0
        self.t = 1000.0
        self.n, self.running, self.waiting, self.ctx = n, running, waiting, ctx
        self.prefill = 512  # prompt tokens chunked into some steps
        self.queued = 0
        self.traffic = TrafficView(30, 60, 60, 2.0, 1024, 128, 0.3, 0.02)

    def worker(self, i: int) -> WorkerView:
        samples = []
        for k in range(32):
            self.step_no += 1
            p = self.prefill if k % 4 == 0 else 0
            seqs = max(1, round(self.running * (0.75 + 0.5 * ((k * 7) % 32) / 32)))  # varies
            kv = seqs * self.ctx
            samples.append([float(self.step_no), COST.step(p, seqs, kv), float(p),
                            float(seqs), float(kv)])  # fmt: skip
        return WorkerView(f"w{i}", self.running, self.waiting, 0.5, samples)

    def observe(self, dt: float = 5.0) -> Observation:
        self.t += dt
        pool = PoolView("generate", [self.worker(i) for i in range(self.n)], self.queued)
        return Observation(self.t, {"generate": pool}, self.traffic)


def _planner(conn: FakeConnector, **kw) -> Planner:  # type: ignore[no-untyped-def]
    cfg = PlannerConfig(**{"ttft_target_s": 0.5, "itl_target_s": 0.05, "max_workers": 8,
                           "gpu_budget": 8, "throughput_loop": False, **kw})  # fmt: skip
    return Planner(cfg, conn)


def test_scales_up_only_when_every_worker_is_over() -> None:
    conn, c = FakeConnector(), Cluster(3, running=45)
    c.traffic.rate = 40.0  # two workers could not carry it: no scale-down either
    p = _planner(conn)
    p.step(c.observe())
    assert conn.asked == []  # ITL p90 ~40 ms: under the 50 ms target
    c.running = 300  # every worker's decode step now ~70 ms: over the ITL target
    p.step(c.observe())
    assert [(d.previous, d.replicas) for d in conn.asked] == [(3, 4)]
    assert "all 3 over" in conn.asked[0].reason


def test_one_worker_under_target_holds_the_pool() -> None:
    conn, c = FakeConnector(), Cluster(3, running=300)
    p = _planner(conn)
    obs = c.observe()
    light = obs.pools["generate"].workers[1]  # this one runs a light batch
    light.samples = [[s[0], COST.step(0, 4, 4000), 0.0, 4.0, 4000.0] for s in light.samples]
    light.running = 4
    p.step(obs)
    assert conn.asked == []


def test_holds_until_the_action_takes_effect() -> None:
    conn, c = FakeConnector(), Cluster(2, running=300)
    p = _planner(conn)
    p.step(c.observe())
    assert len(conn.asked) == 1 and conn.asked[0].replicas == 3
    p.step(c.observe())  # still 2 live, connector not done: no second action
    p.step(c.observe())
    assert len(conn.asked) == 1 and p.plans["generate"].hold is not None
    conn.done = True
    p.step(c.observe())  # done, but the pool still has 2 live: held
    assert len(conn.asked) == 1
    c.n = 3
    p.step(c.observe())  # 3 live and done: released, and still all over: one more
    assert [d.replicas for d in conn.asked] == [3, 4]


def test_hold_times_out() -> None:
    conn, c = FakeConnector(), Cluster(2, running=300)
    p = _planner(conn, hold_timeout_s=12)
    p.step(c.observe())
    p.step(c.observe())
    assert len(conn.asked) == 1
    p.step(c.observe(dt=10))  # 15 s after the action: acted again
    assert len(conn.asked) == 2


def test_clamped_to_max_workers_and_gpu_budget() -> None:
    conn, c = FakeConnector(), Cluster(4, running=300)
    p = _planner(conn, max_workers=4)
    p.step(c.observe())
    assert conn.asked == [] and p.plans["generate"].decisions.get("clamped") == 1
    conn2 = FakeConnector()
    p2 = _planner(conn2, max_workers=16, gpu_budget=10, gpus_per_worker={"generate": 2})
    c.n = 5  # 5 x 2 GPUs = the whole budget
    p2.step(c.observe())
    assert conn2.asked == []
    c.n = 4
    p2.step(c.observe())
    assert [d.replicas for d in conn2.asked] == [5]


def test_scales_down_when_every_worker_is_under_and_one_fewer_fits() -> None:
    conn, c = FakeConnector(), Cluster(4, running=2, ctx=200)
    c.traffic = TrafficView(30, 30, 30, 1.0, 512, 64, 0.05, 0.012)
    p = _planner(conn)
    p.step(c.observe())
    assert [(d.previous, d.replicas) for d in conn.asked] == [(4, 3)]
    assert "under" in conn.asked[0].reason
    # at min_workers: never below
    conn2, c2 = FakeConnector(), Cluster(1, running=2, ctx=200)
    c2.traffic = c.traffic
    _planner(conn2, min_workers=1).step(c2.observe())
    assert conn2.asked == []


def test_no_scale_down_while_requests_queue() -> None:
    conn, c = FakeConnector(), Cluster(4, running=2, ctx=200)
    c.traffic = TrafficView(30, 30, 30, 1.0, 512, 64, 0.05, 0.012)
    c.queued = 3
    _planner(conn).step(c.observe())
    assert conn.asked == []


def test_an_idle_pool_shrinks_whatever_its_estimates_say() -> None:
    """No request in the window and nothing running: a request's TTFT does not depend on
    the pool's size, so the pool shrinks one a tick even where each worker's estimate
    (here: a target under one request's own prefill) is not under the target."""
    conn, c = FakeConnector(), Cluster(3, running=0, ctx=200)
    c.traffic = TrafficView(30, 0, 0, 0.0, 0.0, 0.0, None, None)
    p = _planner(conn, ttft_target_s=1e-4)
    p.step(c.observe())
    assert [(d.previous, d.replicas) for d in conn.asked] == [(3, 2)]
    assert "idle" in conn.asked[0].reason
    c.running = 1  # something runs: the estimates decide again (all over 0.1 ms: grow)
    conn.done, c.n = True, 2
    p.step(c.observe())
    p.step(c.observe())
    assert [(d.previous, d.replicas) for d in conn.asked] == [(3, 2), (2, 3)]
    assert "over target" in conn.asked[1].reason


def test_throughput_loop_raises_the_pool_to_its_floor() -> None:
    conn, c = FakeConnector(), Cluster(1, running=8)
    c.traffic = TrafficView(30, 600, 600, 20.0, 1024, 128, 0.3, 0.02)
    p = _planner(conn, throughput_loop=True, load_loop=False, throughput_interval_s=60,
                 max_workers=64, gpu_budget=64)  # fmt: skip
    p.step(c.observe())  # the first tick fits the model and sizes the pool
    assert len(conn.asked) == 1
    d = conn.asked[0]
    model = p.plans["generate"].model
    load = Load(20.0, 1024, 128)
    # the pool it asked for meets both (TTFT with the margin a 10-s window's p90 needs),
    # one fewer would not
    ttft = 0.5 * (1 + p.cfg.sensitivity) / 2
    ok = model.steady(20.0, load, workers=d.replicas)
    assert ok is not None and ok[0] <= ttft and ok[1] <= 0.05 and d.replicas > 1
    short = model.steady(20.0, load, workers=d.replicas - 1)
    assert short is None or short[0] > ttft or short[1] > 0.05
    assert "throughput" in d.reason and p.plans["generate"].floor == d.replicas


def test_a_cold_pool_is_sized_as_traffic_begins_not_a_throughput_interval_later() -> None:
    """Traffic that begins after the throughput loop's first tick: while the API's window
    has not yet seen it for a whole window, each tick sizes the floor from the rate so far
    (without feeding the forecasters), so the pool grows before its queue does."""
    conn, c = FakeConnector(), Cluster(1, running=8)
    c.traffic = TrafficView(30, 0, 0, 0.0, 0.0, 0.0, None, None)
    p = _planner(conn, throughput_loop=True, load_loop=False, throughput_interval_s=180,
                 max_workers=64, gpu_budget=64, window_s=30)  # fmt: skip
    p.step(c.observe())  # the first tick: fitted, no traffic, nothing to do
    assert conn.asked == [] and p.forecast["rate"].predict() == 0.0
    c.traffic = TrafficView(30, 300, 0, 10.0, 1024, 0.0, None, None)  # no request done yet
    p.step(c.observe())
    # 300 requests, first seen on this tick: over at most one tick (5 s), not the window
    assert len(conn.asked) == 1 and "60.00 req/s" in conn.asked[0].reason
    assert "since traffic began" in conn.asked[0].reason
    assert conn.asked[0].replicas > 1
    assert p.forecast["rate"].predict() == 0.0  # the forecasters wait for their own tick
    conn.done, c.n = True, conn.asked[0].replicas
    c.traffic = TrafficView(30, 1800, 0, 60.0, 1024, 0.0, None, None)
    p.step(c.observe())  # held until the first action took effect
    p.step(c.observe())
    assert len(conn.asked) == 2 and conn.asked[1].replicas > conn.asked[0].replicas
    for _ in range(6):  # a window (30 s) after the traffic began: back to the interval
        p.step(c.observe())
    c.traffic = TrafficView(30, 3600, 0, 120.0, 1024, 0.0, None, None)
    conn.done, c.n = True, conn.asked[-1].replicas
    asked = len(conn.asked)
    p.step(c.observe())
    assert len(conn.asked) == asked
    # the cold start's floor lasted only as long as the cold window: the forecast's (no
    # traffic at the last throughput tick) is back, so the load loop may shrink the pool
    assert p.plans["generate"].floor == 1


def test_a_failed_action_is_counted_not_held() -> None:
    conn, c = FakeConnector(), Cluster(2, running=300)
    conn.fail = True
    p = _planner(conn)
    p.step(c.observe())
    assert p.plans["generate"].hold is None and p.plans["generate"].decisions["failed"] == 1


def test_worker_seconds_integrate_live_workers() -> None:
    conn, c = FakeConnector(), Cluster(3, running=8)
    p = _planner(conn)
    p.step(c.observe())
    p.step(c.observe(dt=10))
    c.n = 1
    p.step(c.observe(dt=4))
    assert p.plans["generate"].worker_seconds == pytest.approx(3 * 10 + 3 * 4)


def test_recorded_run_replays(capsys: pytest.CaptureFixture[str]) -> None:
    """A run recorded under bench/planner_sim.py (10-minute ramp, 8-worker host, targets
    TTFT 4 s / ITL 600 ms, trimmed to each worker's last 6 steps a tick): replayed, the
    loops grow the pool during the ramp up and shrink it after the peak, within bounds."""
    rec = DATA / "recorded.jsonl"
    obs = list(read_recording(rec))
    assert len(obs) > 20
    conn = FakeConnector()
    conn.done = True
    p = Planner(PlannerConfig(ttft_target_s=4.0, itl_target_s=0.6, max_workers=8,
                              gpu_budget=8, throughput_interval_s=60), conn,
                dry_run=True)  # fmt: skip
    for o in obs:
        p.step(o)
    ups = [d for d in conn.asked if d.replicas > d.previous]
    downs = [d for d in conn.asked if d.replicas < d.previous]
    assert ups and downs and ups[0].ts < downs[-1].ts
    assert all(1 <= d.replicas <= 8 for d in conn.asked)
    peak = len(obs) // 2
    assert all(d.ts < obs[peak].ts for d in ups[:3])  # the growing is done early
    assert downs[0].ts > obs[peak // 2].ts


def test_without_a_model_the_observed_quantiles_decide() -> None:
    """A pool whose engine sends no steps (vLLM runs its own): the API's p90s stand for
    every worker, once 8 requests are in the window."""
    conn = FakeConnector()
    p = _planner(conn)
    idle = [WorkerView("w0"), WorkerView("w1")]
    slow = TrafficView(30, 5, 5, 0.2, 512, 64, 0.9, 0.02)  # over the TTFT target, 5 requests
    p.step(Observation(1000.0, {"generate": PoolView("generate", idle)}, slow))
    assert conn.asked == []  # too few requests to count
    slow.requests = 20
    p.step(Observation(1005.0, {"generate": PoolView("generate", idle)}, slow))
    assert [(d.previous, d.replicas) for d in conn.asked] == [(2, 3)]
    conn.done = True
    three = [WorkerView(f"w{i}", running=1) for i in range(3)]
    calm = TrafficView(30, 20, 20, 0.6, 512, 64, 0.1, 0.01)
    p.step(Observation(1010.0, {"generate": PoolView("generate", three)}, calm))
    assert [(d.previous, d.replicas) for d in conn.asked][1:] == [(3, 2)]
    p.step(Observation(1015.0, {"generate": PoolView("generate", three[:2])}, calm))
    assert [(d.previous, d.replicas) for d in conn.asked][2:] == [(2, 1)]
    # a request waiting anywhere keeps the pool as it is
    conn2 = FakeConnector()
    busy = [WorkerView("w0", running=1, waiting=1), WorkerView("w1", running=1)]
    _planner(conn2).step(Observation(1000.0, {"generate": PoolView("generate", busy)}, calm))
    assert conn2.asked == []


def test_no_scale_down_soon_after_growing() -> None:
    """A worker just added is empty and the backlog just cleared: every estimate is low
    for a tick or two. The pool shrinks only after six load intervals."""
    conn, c = FakeConnector(), Cluster(2, running=300)
    c.traffic = TrafficView(30, 30, 30, 1.0, 512, 64, 0.05, 0.012)
    conn.done = True
    p = _planner(conn)
    p.step(c.observe())
    assert [(d.previous, d.replicas) for d in conn.asked] == [(2, 3)]
    c.n, c.running, c.ctx = 3, 2, 200  # all idle now
    for _ in range(5):
        p.step(c.observe())
    assert len(conn.asked) == 1
    p.step(c.observe())  # 30 s after growing
    assert [(d.previous, d.replicas) for d in conn.asked][1:] == [(3, 2)]


def test_the_model_is_calibrated_only_on_a_window_of_one_pool_size() -> None:
    """The API's observed TTFT corrects the pool's model, but not while the window it
    covers still holds requests served by a pool of another size, nor before it has
    seen the traffic for a whole window."""
    conn = FakeConnector()
    c = Cluster(2)
    c.traffic = TrafficView(30, 60, 60, 2.0, 1024, 128, 2.0, 0.02)  # TTFT well over the model's
    p = _planner(conn, window_s=30, ttft_target_s=10.0, itl_target_s=1.0, min_workers=2)
    model = p.plans["generate"].model
    for _ in range(7):  # traffic just began: its window's quantiles lag the queue
        p.step(c.observe())
        assert model.ttft_scale == 1.0
    p.step(c.observe())  # the window has seen the traffic for a whole window
    first = model.ttft_scale
    assert model.coef is not None and first > 1.0
    p.step(c.observe())
    assert model.ttft_scale > first  # a second reading: further toward the observed
    # an action: the pool changes size; readings within the window after it do not count
    c.waiting, c.queued = 200, 400
    p.cfg.ttft_target_s = 0.5
    assert p.step(c.observe()), "every worker over the target: the pool grows"
    at_action = model.ttft_scale
    conn.done, c.n, c.waiting, c.queued = True, 3, 0, 0
    p.cfg.ttft_target_s, p.cfg.min_workers = 10.0, 3  # no further action
    for _ in range(5):  # 25 s < the 30-s window
        p.step(c.observe())
        assert model.ttft_scale == at_action
    p.step(c.observe(dt=10.0))
    assert model.ttft_scale != at_action
