"""The API's traffic counters (cluster.traffic): the in-memory counts, what a flush takes,
a window's sums and the quantiles read from the histograms. Written to and read from a
real Redis in tests/integration/test_traffic.py."""

from __future__ import annotations

import pytest

from cluster.traffic import (
    ITL_BOUNDS,
    TTFT_BOUNDS,
    Traffic,
    TrafficCounter,
    histogram_quantile,
)


def test_the_bounds_resolve_the_sla_ranges() -> None:
    for bounds, lo, hi in ((TTFT_BOUNDS, 0.01, 10.0), (ITL_BOUNDS, 0.001, 1.0)):
        assert list(bounds) == sorted(set(bounds))
        assert bounds[0] <= lo and bounds[-1] >= hi
        inside = [b for b in bounds if lo <= b <= hi]
        assert max(b / a for a, b in zip(inside, inside[1:], strict=False)) < 1.25


def test_quantiles_are_linear_inside_a_bucket() -> None:
    bounds = (0.1, 0.2, 0.4)
    # 10 in (0, 0.1], 10 in (0.1, 0.2], 0 in (0.2, 0.4], 0 above
    counts = [10, 10, 0, 0]
    assert histogram_quantile(bounds, counts, 0.25) == pytest.approx(0.05)
    assert histogram_quantile(bounds, counts, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(bounds, counts, 0.9) == pytest.approx(0.1 + 0.1 * 8 / 10)
    assert histogram_quantile(bounds, counts, 1.0) == pytest.approx(0.2)
    # the rank falls in an empty bucket's range: the next non-empty one holds it
    assert histogram_quantile(bounds, [1, 0, 3, 0], 0.5) == pytest.approx(0.2 + 0.2 * 1 / 3)
    # above every bound: reported as the highest one
    assert histogram_quantile(bounds, [0, 0, 0, 5], 0.9) == 0.4
    assert histogram_quantile(bounds, [0, 0, 0, 0], 0.9) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(bounds, counts, 1.5)


def test_the_counter_takes_what_moved_and_starts_over() -> None:
    c = TrafficCounter()
    assert c.take() == {}
    c.started(100)
    c.started(50)
    c.first_token(0.3)
    c.token_gap(0.02)
    c.token_gap(0.02)
    c.finished(7)
    got = c.take()
    i_ttft = next(i for i, b in enumerate(TTFT_BOUNDS) if b >= 0.3)
    i_itl = next(i for i, b in enumerate(ITL_BOUNDS) if b >= 0.02)
    assert got == {"requests": 2, "finished": 1, "isl_sum": 150, "osl_sum": 7,
                   "ttft_sum": pytest.approx(0.3), "itl_sum": pytest.approx(0.04),
                   f"ttft:{i_ttft}": 1, f"itl:{i_itl}": 2}  # fmt: skip
    assert c.take() == {}
    c.give_back(got)  # a failed write: the counts go out with the next flush
    c.started(1)
    again = c.take()
    assert again["requests"] == 3 and again["isl_sum"] == 151
    assert again[f"itl:{i_itl}"] == 2 and again["finished"] == 1


def test_a_window_sums_its_buckets() -> None:
    c = TrafficCounter()
    for ttft in (0.1, 0.2, 0.3, 0.4):
        c.started(10)
        c.first_token(ttft)
        c.finished(4)
    t = Traffic(span_s=20.0)
    raw = {k: float(v) for k, v in c.take().items()}
    t.add(1, raw)
    t.add(2, {**raw, "ttft:999": 1.0, "unknown": 5.0})  # newer bounds, a newer field
    assert (t.requests, t.finished, t.ttft_count) == (8, 8, 9)
    assert t.rate == pytest.approx(8 / 20)
    assert (t.isl_mean, t.osl_mean) == (10, 4)
    assert t.ttft_counts[-1] == 1  # past the last bound: the overflow bucket
    assert t.per_bucket[1] == raw
    p50 = t.ttft_quantile(0.5)
    assert p50 is not None and 0.2 <= p50 <= 0.3 * 1.2
    assert t.itl_quantile(0.9) is None and Traffic(span_s=5).isl_mean is None
