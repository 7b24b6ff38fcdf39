"""bench/replay.py and bench/trace_gen.py, offline parts: no server, no Redis."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str) -> ModuleType:
    """bench/ is not a package: load a script by path (registered, as dataclasses need)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"bench/{name}.py not found"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


tg = _load("trace_gen")
replay = _load("replay")
Req = tg.TraceRequest


# --- Trace parsing --------------------------------------------------------------------
def test_parse_mooncake_lines_in_arrival_order() -> None:
    lines = [
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
        '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}',
        "",
        '{"timestamp": 0, "input_length": 300, "output_length": 7, "hash_ids": [46]}',
        '{"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1, 2]}',
    ]
    reqs = tg.parse_trace(lines)
    assert [r.timestamp_ms for r in reqs] == [0, 0, 27482]
    assert [r.input_length for r in reqs] == [300, 9, 6955]  # stable for equal timestamps
    assert reqs[2].output_length == 52
    assert reqs[2].hash_ids[:2] == [46, 47] and len(reqs[2].hash_ids) == 14


@pytest.mark.parametrize(
    "line",
    [
        '{"timestamp": 0, "input_length": 5}',
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}',
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}',
        "not json",
    ],
)
def test_parse_rejects_malformed_lines_with_their_number(line: str) -> None:
    ok = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(ValueError, match="line 2"):
        tg.parse_trace([ok, line])


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    reqs = [Req(0, 10, 3, [1, 2]), Req(12.5, 600, 1, [1, 2, 9])]
    tg.write_trace(reqs, tmp_path / "t.jsonl")
    assert tg.read_trace(tmp_path / "t.jsonl") == reqs


def test_scale_trace_divides_lengths_keeps_hash_ids() -> None:
    reqs = [Req(0, 1000, 100, [1, 2]), Req(5, 512, 3, [1])]
    out = tg.scale_trace(reqs, 512, scale_down=4)
    assert tg.scaled_block_tokens(512, 4) == 128
    assert [(r.input_length, r.output_length) for r in out] == [(250, 25), (128, 1)]
    assert [r.hash_ids for r in out] == [[1, 2], [1]] and out[1].timestamp_ms == 5
    out = tg.scale_trace(reqs, 512, 4, output_scale_down=1, max_output_tokens=50)
    assert [r.output_length for r in out] == [50, 3]
    out = tg.scale_trace(reqs, 512, 4, max_input_tokens=200)
    assert [r.input_length for r in out] == [200, 128]
    with pytest.raises(ValueError, match="tokens-per-hash-id"):
        tg.scale_trace([Req(0, 1100, 1, [1, 2])], 512)


# --- Prompt construction --------------------------------------------------------------
def test_shared_leading_hash_ids_give_identical_token_prefixes() -> None:
    block = 32
    a = tg.prompt_tokens(Req(0, 3 * block, 1, [7, 8, 9]), block)
    b = tg.prompt_tokens(Req(0, 3 * block, 1, [7, 8, 10]), block)
    c = tg.prompt_tokens(Req(0, 2 * block + 5, 1, [7, 8, 9]), block)
    assert len(a) == len(b) == 3 * block and len(c) == 2 * block + 5
    assert a[: 2 * block] == b[: 2 * block]
    assert a[2 * block :] != b[2 * block :]  # different hash ids, different blocks
    assert c == a[: 2 * block + 5]  # a partial last block is the block's head
    assert all(isinstance(t, int) and 32 <= t < 500 for t in a + b + c)


def test_block_content_depends_on_the_hash_id_alone() -> None:
    assert tg.block_tokens(7, 64).tolist() == tg.block_tokens(7, 64).tolist()
    assert tg.block_tokens(7, 64).tolist() != tg.block_tokens(8, 64).tolist()
    assert tg.block_tokens(7, 16).tolist() == tg.block_tokens(7, 64).tolist()[:16]
    ids = tg.block_tokens(123, 4096, (5, 9)).tolist()
    assert set(ids) == {5, 6, 7, 8}


# --- Ideal prefix reuse ---------------------------------------------------------------
def test_ideal_reusable_on_a_hand_made_trace() -> None:
    # 4 tokens per hash id, engine blocks of 2 tokens
    trace = [
        Req(0, 8, 1, [1, 2]),  # nothing seen: 0
        Req(1, 11, 1, [1, 2, 3]),  # 1, 2 whole (8), 3 new: 8
        Req(2, 6, 1, [1, 5]),  # 1 (4), 5 new: 4
        Req(3, 9, 1, [1, 2, 3]),  # 4 + 4 + 1 of 3 = 9, capped at 9 - 1 = 8
        Req(4, 16, 1, [1, 2, 3, 4]),  # 4 + 4 + 3 (the most of block 3 seen) = 11 -> 10
        Req(5, 8, 1, [9, 2]),  # 2 under a different first block is a different block: 0
        Req(6, 3, 1, [1]),  # 3 of block 1, capped at 3 - 1 = 2
        Req(7, 16, 1, [1, 2, 3, 4]),  # 4 + 4 + 4 (Req 4 had all of 3) + 4, capped at 15 -> 14
    ]
    assert tg.ideal_reusable(trace, 4, 2) == [0, 8, 4, 8, 10, 0, 2, 14]
    assert tg.ideal_reusable(trace, 4, 4) == [0, 8, 4, 8, 8, 0, 0, 12]
    st = tg.trace_stats(trace, tg.ideal_reusable(trace, 4, 2))
    assert st["prompt_tokens"] == 77 and st["ideal_reusable_tokens"] == 46
    assert st["unique_hash_ids"] == 6 and st["span_s"] == pytest.approx(0.007)


# --- Synthetic generator --------------------------------------------------------------
def test_synthetic_trace_is_deterministic_per_seed() -> None:
    cfg = tg.SyntheticConfig(sessions=12, turns=3, seed=3)
    a = [r.to_json() for r in tg.synthesize(cfg)]
    b = [r.to_json() for r in tg.synthesize(tg.SyntheticConfig(sessions=12, turns=3, seed=3))]
    c = [r.to_json() for r in tg.synthesize(tg.SyntheticConfig(sessions=12, turns=3, seed=4))]
    assert a == b and a != c
    assert len(a) == 36


def test_synthetic_trace_shape() -> None:
    cfg = tg.SyntheticConfig(system_prompts=2, system_len=3, sessions=5, turns=3, user_len=2,
                             output_len=700, tokens_per_hash_id=512)  # fmt: skip
    reqs = tg.synthesize(cfg)
    assert len(reqs) == 15
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(reqs, reqs[1:], strict=False))
    systems = [[0, 1, 2], [3, 4, 5]]
    for r in reqs:
        assert r.hash_ids[:3] in systems
        assert r.input_length == len(r.hash_ids) * 512 and r.output_length == 700
    # turn k+1 = turn k's prompt + 2 answer blocks (700 tokens) + 2 new user blocks
    lengths = sorted({len(r.hash_ids) for r in reqs})
    assert lengths == [5, 9, 13]
    for r in reqs:
        if len(r.hash_ids) > 5:
            prev = [p for p in reqs if p.hash_ids == r.hash_ids[: len(r.hash_ids) - 4]]
            assert len(prev) == 1 and prev[0].timestamp_ms <= r.timestamp_ms
            # the user thinks (2 s by default) before the next turn of a conversation
            assert r.timestamp_ms - prev[0].timestamp_ms >= cfg.think_time_s * 1000


def test_default_synthetic_trace_is_prefix_heavy() -> None:
    reqs = tg.synthesize(tg.SyntheticConfig())
    st = tg.trace_stats(reqs, tg.ideal_reusable(reqs, 512, 16))
    assert 0.7 <= st["ideal_fraction"] <= 0.9
    # 768 requests at 20/s, slowed a little by the users' think time
    assert st["requests"] == 768
    assert 35 <= st["span_s"] <= 50
    # scaled down 8x the fraction stays (whole blocks stay whole)
    small = tg.scale_trace(reqs, 512, 8)
    st8 = tg.trace_stats(small, tg.ideal_reusable(small, 64, 16))
    assert st8["ideal_fraction"] == pytest.approx(st["ideal_fraction"], abs=0.01)


def test_gen_subcommand_writes_a_parseable_trace(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.jsonl"
    assert replay.main(["gen", "--out", str(out), "--sessions", "3", "--turns", "2"]) == 0
    reqs = tg.read_trace(out)
    assert len(reqs) == 6
    assert json.loads(out.read_text().splitlines()[0]).keys() == {
        "timestamp", "input_length", "output_length", "hash_ids"
    }  # fmt: skip
    assert "reusable" in capsys.readouterr().out


# --- Metrics --------------------------------------------------------------------------
def test_load_spread_on_hand_made_samples() -> None:
    samples = [[0, 0, 0], [2, 2, 2], [6, 0, 0], []]
    s = replay.load_spread(samples)
    assert s["samples"] == 4 and s["busy_samples"] == 2
    assert s["imbalance_mean"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert s["imbalance_p95"] == pytest.approx(2.9)  # 1 + (3 - 1) * 0.95
    assert s["mean_blocks"] == pytest.approx(4 / 3)  # (0 + 2 + 2) / 3 live samples
    assert s["max_blocks"] == pytest.approx(8 / 3)  # (0 + 2 + 6) / 3
    assert s["peak_blocks"] == 6
    idle = replay.load_spread([[0, 0], []])
    assert idle["busy_samples"] == 0 and math.isnan(idle["imbalance_mean"])


def test_load_summary_keeps_per_worker_means() -> None:
    out = replay.load_summary([{"a": 4, "b": 0}, {"a": 2, "b": 2}, {"b": 6}])
    assert out["per_worker_mean_blocks"] == {"a": 3.0, "b": 8 / 3}
    assert out["spread"] == pytest.approx(3.0 / ((3.0 + 8 / 3) / 2))
    assert out["imbalance_mean"] == pytest.approx((2.0 + 1.0 + 1.0) / 3)


def test_summarize_hit_rate_and_errors() -> None:
    R = replay.Record

    def rec(i: int, ideal: int, cached: int, ttft: float, error: str | None = None):
        return R(i, 100, 10, ideal, scheduled_s=0.0, sent_s=0.01, ttft_ms=ttft, e2e_ms=50.0,
                 prompt_tokens=100, cached_tokens=cached, completion_tokens=10,
                 error=error)  # fmt: skip

    recs = [rec(0, 0, 0, 10.0), rec(1, 64, 48, 20.0), rec(2, 96, 96, 30.0),
            rec(3, 80, 0, math.nan, error="HTTP 400")]  # fmt: skip
    s = replay.summarize(recs, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["hit_rate"] == pytest.approx(144 / 160)
    assert s["reused_fraction"] == pytest.approx(144 / 300)
    assert s["ttft_p50_ms"] == 20.0 and s["ttft_mean_ms"] == 20.0
    assert s["req_s"] == 1.5 and s["out_tok_s"] == 15.0
    assert s["short_outputs"] == 0 and s["prompt_mismatches"] == 0
    kv = {"summary": {"ttft_mean_ms": 20.0}}
    rr = {"summary": {"ttft_mean_ms": 50.0}}
    assert replay.ttft_ratios({"kv": kv, "round_robin": rr}) == {"round_robin": 2.5}


def test_report_table_has_one_aligned_row_per_mode() -> None:
    recs = [replay.Record(0, 100, 10, 64, 0.0, 0.0, 5.0, 9.0, 100, 64, 10)]
    res = {m: {"summary": replay.summarize(recs, 1.0), "load": None, "error_kinds": {}}
           for m in ("kv", "round_robin")}  # fmt: skip
    trace = dict(requests=1, span_s=0.0, replay_span_s=0.0, prompt_tokens=100,
                 ideal_fraction=0.64, block_tokens=64)  # fmt: skip
    text = replay.report(res, trace)
    rows = [ln for ln in text.splitlines() if ln.startswith(("mode", "kv", "round_robin"))]
    assert len(rows) == 3 and len({len(r) for r in rows}) == 1
    assert "100.0" in rows[1]  # hit rate
    assert "round_robin / kv = 1.00x" in text


def test_cli_parses_flags() -> None:
    ap = replay.build_parser()
    args = ap.parse_args(["--synthetic", "--start-server", "--modes", "kv,random",
                          "--server-env", "CONVEYOR_MAX_MODEL_LEN=16384",
                          "--token-range", "40,300"])  # fmt: skip
    assert args.modes == ["kv", "random"] and args.token_range == (40, 300)
    assert args.server_env == [("CONVEYOR_MAX_MODEL_LEN", "16384")]
    assert args.workers == 8 and args.max_inflight == 256 and args.tokens_per_hash_id == 512
    with pytest.raises(SystemExit):
        ap.parse_args(["--synthetic", "--modes", "kv,least_loaded"])
