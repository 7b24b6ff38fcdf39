"""bench/serve_latency.py's workload and timing helpers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from serve_latency import (  # noqa: E402
    output_lengths,
    pool_rounds,
    request_record,
    round_result,
    summarize,
    workload,
)


def test_output_lengths_spread_around_the_mean_and_repeat_for_a_seed() -> None:
    a = output_lengths(2000, 64, 0.5, seed=0)
    assert a == output_lengths(2000, 64, 0.5, seed=0)
    assert a != output_lengths(2000, 64, 0.5, seed=1)
    assert min(a) >= 32 and max(a) <= 96 and len(set(a)) > 50
    assert abs(sum(a) / len(a) - 64) < 1.5
    assert output_lengths(10, 64, 0.0, seed=0) == [64] * 10
    assert min(output_lengths(100, 2, 1.0, seed=0)) == 2  # never fewer than 2 tokens


def test_every_round_and_reference_gets_new_prompts_and_the_same_lengths() -> None:
    levels, counts = [1, 16], {1: 3, 16: 5}
    r0, f0 = workload(levels, counts, 8, 64, 0.5, vocab=512, seed=0, round_index=0)
    r1, f1 = workload(levels, counts, 8, 64, 0.5, vocab=512, seed=0, round_index=1)
    assert r0 == workload(levels, counts, 8, 64, 0.5, vocab=512, seed=0, round_index=0)[0]
    assert [len(r0[c]) for c in levels] == [3, 5] and len(r0["warmup"]) == 2
    timed = [[tuple(p) for c in levels for p, _ in side[c]] for side in (r0, f0, r1, f1)]
    everything = [p for side in timed for p in side]
    assert len(set(everything)) == len(everything)  # no timed prompt is ever sent twice
    assert all(len(p) == 8 and min(p) >= 5 for p in everything)
    for c in levels:  # the same work every round: only the prompt ids change
        assert [n for _, n in r0[c]] == [n for _, n in r1[c]]
        assert {n for _, n in f0[c]} == {64}
    lengths = [n for _, n in r0["warmup"]] + [n for c in levels for _, n in r0[c]]
    assert lengths == output_lengths(10, 64, 0.5, seed=0)
    assert r0["warmup"] == r1["warmup"]  # untimed


def test_request_record_times_ttft_itl_and_tpot() -> None:
    # t0 = 0; text at 10, 12 and 16 ms, a token with no text between, the finish at 20 ms
    events = [(0.010, "a", False), (0.012, "b", False), (0.016, "c", False),
              (0.020, "", True)]  # fmt: skip
    r = request_record(0.0, events, tokens=5, asked=5)
    assert r["cached"] == 0 and request_record(0.0, events, 5, 5, cached=32)["cached"] == 32
    assert math.isclose(r["ttft_ms"], 10) and math.isclose(r["e2e_ms"], 20)
    assert [round(x, 6) for x in r["itl_ms"]] == [2.0, 4.0]
    assert math.isclose(r["tpot_ms"], (20 - 10) / 4)
    assert r["text_events"] == 3 and r["asked"] == 5
    one = request_record(0.0, [(0.005, "x", True)], tokens=1, asked=1)
    s = summarize([r, one], wall_s=1.0)
    assert math.isclose(s["tpot_p50"], 2.5)  # a one-token request has no TPOT
    assert s["completion_tokens"] == 6


def _side(itl_ms: list[float], tokens: int, wall_s: float, cpu_s: float) -> dict:
    rec = dict(ttft_ms=10.0, e2e_ms=50.0, tpot_ms=1.0, itl_ms=itl_ms, tokens=tokens,
               asked=tokens, events=len(itl_ms) + 1, text_events=len(itl_ms) + 1)  # fmt: skip
    return {"summary": summarize([rec], wall_s), "requests": [rec], "cpu_s": {"api": cpu_s}}


def test_rounds_are_pooled_per_side_and_each_round_ratio_is_kept() -> None:
    # round 1: the server at half the in-process speed; round 2: equal
    r1 = ({16: _side([4.0, 4.0, 4.0], 100, 1.0, 0.5)}, {16: _side([9.0, 9.0, 9.0], 100, 2.0, 1.0)},
          {}, {})  # fmt: skip
    r2 = ({16: _side([4.0, 8.0, 8.0], 100, 1.0, 0.5)}, {16: _side([5.0, 5.0, 5.0], 100, 1.0, 0.2)},
          {}, {})  # fmt: skip
    res: dict = {}
    pool_rounds(res, [r1, r2], [16])
    srv, inp = res["server"][16], res["inprocess"][16]
    assert len(srv["requests"]) == 2 and srv["summary"]["requests"] == 2
    # percentiles over both rounds' gaps, not one round's
    assert srv["summary"]["itl_p50"] == 7.0  # [5, 5, 5, 9, 9, 9]
    assert inp["summary"]["itl_p50"] == 4.0  # [4, 4, 4, 4, 8, 8]
    assert math.isclose(srv["summary"]["tok_s"], 200 / 3.0)  # all tokens / all wall time
    assert math.isclose(srv["cpu_s"]["api"], 1.2)
    assert res["round_ratios"][16] == [50.0, 100.0]
    assert [s["wall_s"] for s in res["round_summaries"]["server"][16]] == [2.0, 1.0]
    assert res["lockstep"] == {}  # no round ran it


def test_the_reference_is_pooled_from_the_rounds_that_ran_it_only() -> None:
    inp, srv = {16: _side([4.0], 100, 1.0, 0.5)}, {16: _side([5.0], 100, 1.0, 0.5)}
    lock, fixed = {16: _side([3.0], 100, 1.0, 0.5)}, {16: _side([6.0], 100, 2.0, 0.5)}
    first = round_result(inp, srv, lock, fixed)
    later = round_result(inp, srv, {}, {})
    assert later == (inp, srv, {}, {})  # its server run is not one at the reference's length
    res: dict = {}
    pool_rounds(res, [first, later, later], [16])
    assert len(res["server"][16]["requests"]) == 3  # the targets: every round
    assert len(res["lockstep"][16]["requests"]) == 1
    assert res["server_fixed"][16]["summary"]["itl_p50"] == 6.0  # round 1's own run only
    assert res["round_ratios"][16] == [100.0, 100.0, 100.0]
    # no spread: the main server run is the one at the reference's length
    assert round_result(inp, srv, lock, {})[3] is srv


def test_a_level_that_ran_in_the_first_rounds_only_is_pooled_from_those() -> None:
    both = ({1: _side([9.0], 10, 1.0, 0.1), 16: _side([4.0], 100, 1.0, 0.5)},
            {1: _side([9.0], 5, 1.0, 0.1), 16: _side([5.0], 100, 2.0, 0.5)}, {}, {})  # fmt: skip
    top = ({16: _side([4.0], 100, 1.0, 0.5)}, {16: _side([5.0], 100, 1.0, 0.5)}, {}, {})
    res: dict = {}
    pool_rounds(res, [both, top, top], [1, 16])
    assert res["round_ratios"] == {1: [50.0], 16: [50.0, 100.0, 100.0]}
    assert len(res["server"][1]["requests"]) == 1 and len(res["server"][16]["requests"]) == 3
    assert math.isclose(res["server"][16]["summary"]["tok_s"], 300 / 4.0)
