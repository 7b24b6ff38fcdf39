"""bench/serve_latency.py's workload and timing helpers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from serve_latency import output_lengths, request_record, summarize  # noqa: E402


def test_output_lengths_spread_around_the_mean_and_repeat_for_a_seed() -> None:
    a = output_lengths(2000, 64, 0.5, seed=0)
    assert a == output_lengths(2000, 64, 0.5, seed=0)
    assert a != output_lengths(2000, 64, 0.5, seed=1)
    assert min(a) >= 32 and max(a) <= 96 and len(set(a)) > 50
    assert abs(sum(a) / len(a) - 64) < 1.5
    assert output_lengths(10, 64, 0.0, seed=0) == [64] * 10
    assert min(output_lengths(100, 2, 1.0, seed=0)) == 2  # never fewer than 2 tokens


def test_request_record_times_ttft_itl_and_tpot() -> None:
    # t0 = 0; text at 10, 12 and 16 ms, a token with no text between, the finish at 20 ms
    events = [(0.010, "a", False), (0.012, "b", False), (0.016, "c", False),
              (0.020, "", True)]  # fmt: skip
    r = request_record(0.0, events, tokens=5, asked=5)
    assert math.isclose(r["ttft_ms"], 10) and math.isclose(r["e2e_ms"], 20)
    assert [round(x, 6) for x in r["itl_ms"]] == [2.0, 4.0]
    assert math.isclose(r["tpot_ms"], (20 - 10) / 4)
    assert r["text_events"] == 3 and r["asked"] == 5
    one = request_record(0.0, [(0.005, "x", True)], tokens=1, asked=1)
    s = summarize([r, one], wall_s=1.0)
    assert math.isclose(s["tpot_p50"], 2.5)  # a one-token request has no TPOT
    assert s["completion_tokens"] == 6
