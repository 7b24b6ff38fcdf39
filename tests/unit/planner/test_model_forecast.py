"""The step model's fit and answers, and the forecasters, on generated samples."""

from __future__ import annotations

import numpy as np
import pytest

from planner.forecast import Arima, Constant, Kalman, make_forecaster
from planner.model import MIN_SAMPLES, Coefficients, Load, StepModel

TRUE = Coefficients(base=0.006, per_prefill_token=50e-6, per_seq=0.1e-3, per_kv_token=0.05e-6)


def _samples(n: int, seed: int = 0, noise: float = 0.0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prefill = float(rng.choice([0, 0, 0, rng.integers(1, 2048)]))
        seqs = float(rng.integers(1, 64))
        kv = seqs * float(rng.integers(100, 4000))
        wall = TRUE.step(prefill, seqs, kv) * (1 + noise * float(rng.standard_normal()))
        out.append([float(i), wall, prefill, seqs, kv])
    return out


def test_fit_recovers_the_step_cost() -> None:
    m = StepModel()
    assert m.add("w1", _samples(400, noise=0.02)) and m.fit() is not None
    c = m.coef
    assert c is not None and m.r2 > 0.95
    for got, want in zip((c.base, c.per_prefill_token, c.per_seq, c.per_kv_token),
                         (TRUE.base, TRUE.per_prefill_token, TRUE.per_seq,
                          TRUE.per_kv_token), strict=True):  # fmt: skip
        assert got == pytest.approx(want, rel=0.15)


def test_no_fit_before_enough_samples_and_samples_taken_once() -> None:
    m = StepModel()
    s = _samples(MIN_SAMPLES - 1)
    assert len(m.add("w1", s)) == MIN_SAMPLES - 1
    assert m.fit() is None
    assert m.add("w1", s) == []  # the same report again: nothing new
    assert len(m.add("w2", s[:1])) == 1  # another worker's steps count on their own
    assert m.fit() is not None
    m.forget({"w2"})  # w1 left: a new w1 (restarted) counts from its step 0 again
    assert len(m.add("w1", s[:3])) == 3


def test_coefficients_never_negative() -> None:
    m = StepModel()
    rng = np.random.default_rng(1)
    # step time falls slightly with prefill in the data (noise): the fit drops the column
    m.add("w", [[float(i), 0.01 - 1e-7 * p, p, 8.0, 800.0]
                for i, p in enumerate(rng.integers(0, 2000, 200).astype(float))])  # fmt: skip
    c = m.fit()
    assert c is not None
    assert min(c.base, c.per_prefill_token, c.per_seq, c.per_kv_token) >= 0


def test_capacity_meets_the_targets_and_more_does_not() -> None:
    m = StepModel()
    m.add("w", _samples(300))
    m.fit()
    load = Load(0, isl=1024, osl=128)
    cap = m.capacity(load, ttft_target=0.5, itl_target=0.02)
    assert cap is not None and cap > 0
    ok = m.steady(cap * 0.99, load)
    assert ok is not None and ok[0] <= 0.5 and ok[1] <= 0.02
    worse = m.steady(cap * 1.05, load)
    assert worse is None or worse[0] > 0.5 or worse[1] > 0.02
    # an ITL target under the decode step's at that batch: fewer requests a worker;
    # decode-only pools ignore TTFT
    assert m.capacity(load, 0.5, 0.007) < cap  # type: ignore[operator]
    assert m.capacity(load, 1e-6, 0.02, prefill=False) > 0  # type: ignore[operator]


def test_ttft_grows_with_the_queue() -> None:
    m = StepModel()
    m.add("w", _samples(300))
    m.fit()
    a, b = m.ttft(1024, 8, 8000), m.ttft(10 * 1024, 8, 8000)
    assert a is not None and b is not None and b > 5 * a


@pytest.mark.parametrize("kind", ["constant", "kalman", "arima"])
def test_forecasters_follow_a_level(kind: str) -> None:
    f = make_forecaster(kind)
    assert f.predict() is None
    for _ in range(30):
        f.observe(10.0)
    assert f.predict() == pytest.approx(10.0, rel=0.05)


def test_kalman_and_arima_follow_a_ramp_better_than_constant() -> None:
    fs = {"constant": Constant(), "kalman": Kalman(), "arima": Arima()}
    errs = {k: 0.0 for k in fs}
    for t in range(40):
        value = 2.0 + 0.5 * t
        for k, f in fs.items():
            p = f.predict()
            if t > 10 and p is not None:
                errs[k] += abs(p - value)
            f.observe(value)
    assert errs["kalman"] < 0.5 * errs["constant"]
    assert errs["arima"] < 0.5 * errs["constant"]


def test_forecasts_never_negative_and_unknown_kind_refused() -> None:
    f = Kalman()
    for v in (10.0, 5.0, 1.0, 0.0):
        f.observe(v)
    assert (f.predict() or 0) >= 0
    with pytest.raises(ValueError, match="unknown forecaster"):
        make_forecaster("prophet")


def test_itl_quantile_is_the_chunk_step_once_chunks_are_common() -> None:
    """p90 ITL: the decode-only step while fewer than 10% of steps carry a prompt chunk,
    the chunk-carrying step's time beyond."""
    m = StepModel(quantile=0.9)
    m.add("w", _samples(300))
    m.fit()
    load = Load(0, isl=1024, osl=128)
    lo, hi = m.steady(0.5, load), m.steady(9.0, load)
    assert lo is not None and hi is not None
    c = m.coef
    assert c is not None
    assert lo[1] < c.base + c.per_prefill_token * 512  # chunks rare: no chunk cost in p90
    assert hi[1] > c.base + c.per_prefill_token * min(1024, m.chunk_tokens)  # chunks common


def test_a_pool_queues_less_than_its_workers_alone() -> None:
    """Random arrivals spread over more workers wait less at the same load per worker
    (M/M/c): the per-worker capacity within a TTFT quantile grows with the pool, and
    the wait's quantile matches M/M/1's closed form for one worker."""
    from planner.model import _wait_quantile

    assert _wait_quantile(1, 0.5, 1.0, 0.9) == pytest.approx(np.log(5) / 0.5)
    assert _wait_quantile(8, 2.0, 1.0, 0.9) == 0.0  # rarely all 8 busy: no wait at p90
    m = StepModel()
    m.add("w", _samples(300))
    m.fit()
    load = Load(0, isl=1024, osl=128)
    one = m.capacity(load, 0.15, 1.0, workers=1)  # TTFT binds, not ITL
    eight = m.capacity(load, 0.15, 1.0, workers=8)
    assert one is not None and eight is not None and eight > one
    need = m.workers_for(Load(8 * eight * 0.99, 1024, 128), 0.15, 1.0)
    assert need is not None and need <= 8


def test_a_prompt_just_over_a_chunk_costs_a_fraction_of_a_step_more() -> None:
    """Prompts share a step's token budget, so a prompt's time in its worker's prefill
    slot grows with its length, not by a whole step at each chunk's edge (a mean ISL of
    518 with 256-token chunks once sized a pool as if every prompt took 3 steps)."""
    m = StepModel(quantile=0.9)
    m.coef = Coefficients(base=0.16, per_prefill_token=1.2e-3, per_seq=1.6e-3,
                          per_kv_token=0.4e-6)  # fmt: skip
    m.max_prefill = 256
    at = m.steady(4.0, Load(4.0, 512, 48), workers=6)
    over = m.steady(4.0, Load(4.0, 518, 48), workers=6)
    assert at is not None and over is not None
    assert over[0] > at[0]
    assert over[0] < at[0] * 1.05
    need = [m.workers_for(Load(4.91, isl, 48), 4.0, 0.6) for isl in (512, 518)]
    assert need[0] == need[1]


def test_a_target_no_pool_can_meet_asks_for_no_more_workers_than_help() -> None:
    """A TTFT target under one request's own prefill on an idle worker is out of reach
    at any size: the pool sized is the one that comes near what one request alone gets
    (an idle pool with such a target once asked for its maximum)."""
    m = StepModel()
    m.add("w", _samples(300))
    m.fit()
    load = Load(0.0, isl=1024, osl=128)
    alone = m.steady(0.0, load)
    assert alone is not None
    assert m.workers_for(load, alone[0] / 2, 1.0) == 1  # idle: one worker
    busy = Load(40.0, isl=1024, osl=128)
    need = m.workers_for(busy, alone[0] / 2, 1.0)
    assert need is not None and 1 < need < 1025
    s = m.steady(busy.rate, busy, workers=need)
    assert s is not None and s[0] <= alone[0] * 1.05


def test_calibration_moves_the_model_toward_what_the_api_observed() -> None:
    """The scales move a fifth of the way to observed / modelled on each reading, stay
    within their bounds, and every estimate, and so the pool sized, follows them."""
    from planner.model import CALIBRATE_WEIGHT, SCALE_BOUNDS

    m = StepModel()
    m.add("w", _samples(300))
    m.fit()
    load = Load(40.0, isl=1024, osl=128)  # enough that the pool's queue counts
    raw, alone = m.steady(load.rate, load, workers=4), m.steady(0.0, load)
    assert raw is not None and alone is not None
    target = 2 * alone[0]  # within reach at scale 1.5 too
    base_need = m.workers_for(load, target, 1.0)
    m.calibrate(load, 4, True, True, ttft=raw[0] * 1.5, itl=raw[1] * 1.2)
    assert m.ttft_scale == pytest.approx(1 + CALIBRATE_WEIGHT * 0.5)
    assert m.itl_scale == pytest.approx(1 + CALIBRATE_WEIGHT * 0.2)
    for _ in range(40):  # the same reading again and again: the scale settles on it
        m.calibrate(load, 4, True, True, ttft=raw[0] * 1.5, itl=None)
    assert m.ttft_scale == pytest.approx(1.5, rel=1e-3)
    scaled = m.steady(load.rate, load, workers=4)
    assert scaled is not None and scaled[0] == pytest.approx(raw[0] * 1.5, rel=1e-3)
    need = m.workers_for(load, target, 1.0)
    assert base_need is not None and need is not None and need > base_need
    for _ in range(40):  # a wild reading is believed only as far as the bounds
        m.calibrate(load, 4, True, False, ttft=raw[0] * 50, itl=None)
    assert m.ttft_scale == pytest.approx(SCALE_BOUNDS[1], rel=1e-3)
    for _ in range(40):  # a pool doing better than the model says: never below it
        m.calibrate(load, 4, True, True, ttft=raw[0] * 0.2, itl=raw[1] * 0.2)
    assert (m.ttft_scale, m.itl_scale) == pytest.approx((SCALE_BOUNDS[0],) * 2, rel=1e-3)
    m.calibrate(load, 4, True, True, ttft=raw[0] * 1.5, itl=raw[1] * 1.2)
    # a decode pool's TTFT says nothing about its model; a load it cannot carry, nothing
    before = m.ttft_scale, m.itl_scale
    m.calibrate(load, 4, False, True, ttft=raw[0] * 0.1, itl=None)
    m.calibrate(Load(1e6, 1024, 128), 4, True, True, ttft=0.01, itl=0.001)
    assert (m.ttft_scale, m.itl_scale) == before
