"""The heartbeat report on the wire: typed both ways (cluster.stats, cluster.membership),
flat JSON as before, and readable from an older or newer worker."""

from __future__ import annotations

import json
import pickle

from cluster.membership import HeartbeatReport
from cluster.stats import EngineStats, ImageCounters, KvbmCounters, TransferTotals


def _full() -> HeartbeatReport:
    kv = KvbmCounters(matched_tokens={"g1": 32, "g2": 16}, lookup_blocks=5, host_hit_blocks=3,
                      offload_blocks={"d2h": 4}, offload_bytes={"d2h": 4096},
                      onboard_blocks={"h2d": 2}, onboard_bytes={"h2d": 2048},
                      onboard_latency_buckets=[0.001, 0.01], onboard_latency_counts=[1, 0, 2],
                      onboard_latency_sum=0.5, host_blocks_used=4, host_blocks_total=64,
                      host_blocks_pinned=1)  # fmt: skip
    st = EngineStats(running=2, waiting=1, blocks_used=7, blocks_total=128, blocks_cached=9,
                     prompt_tokens_seen=100, prompt_tokens_cached=40, steps=12,
                     host_blocks_used=4, host_blocks_total=64, kvbm=kv, step_seconds=1.25,
                     frames_published=30, kv_events=6, kv_event_batches=2,
                     decode_tokens=50, decode_kv_tokens=4000,
                     step_samples=[[11, 0.02, 64, 1, 80], [12, 0.006, 0, 2, 162]],
                     kv_transfer=TransferTotals("shm", 1 << 20, 0.5, 3),
                     embedding_transfer=TransferTotals("redis", 512, 0.1, 1),
                     images=ImageCounters(images_encoded=2, cache_hits=1,
                                          cache_bytes=99))  # fmt: skip
    return HeartbeatReport("w1", "generate", "host-a", 1700000000.5, active=3, inflight=2,
                           engine_pid=4242, stats=st)  # fmt: skip


def test_a_report_round_trips_through_its_json() -> None:
    rep = _full()
    assert HeartbeatReport.decode(rep.encode()) == rep
    assert HeartbeatReport.decode(rep.encode().encode()) == rep  # as Redis hands it back


def test_the_wire_is_flat_json_with_the_parts_a_worker_has() -> None:
    d = json.loads(_full().encode())
    assert (d["worker_id"], d["pool"], d["active"], d["engine_pid"]) == ("w1", "generate", 3, 4242)
    assert (d["blocks_used"], d["frames_published"], d["step_seconds"]) == (7, 30, 1.25)
    assert d["step_samples"][-1] == [12, 0.006, 0, 2, 162] and d["decode_kv_tokens"] == 4000
    assert d["kv_transfer"] == {"backend": "shm", "bytes": 1 << 20, "seconds": 0.5, "count": 3,
                                "failed": 0}  # fmt: skip
    assert d["kvbm"]["onboard_blocks"] == {"h2d": 2} and d["images"]["cache_hits"] == 1
    bare = json.loads(HeartbeatReport("w2", "decode").encode())
    # parts the worker has not got are left out, not sent as null
    assert not {"kvbm", "kv_transfer", "embedding_transfer", "images", "vllm_unfinished",
                "encode_requests"} & bare.keys()  # fmt: skip
    assert bare["running"] == 0 and bare["engine_pid"] is None


def test_an_older_workers_report_parses_with_defaults() -> None:
    # as a worker before the typed stats wrote it: fewer counters, tiers off as {}, a
    # transfer without "failed"
    old = {"running": 1, "waiting": 0, "blocks_used": 3, "blocks_total": 64, "kvbm": {},
           "kv_transfer": {"backend": "nixl", "bytes": 10, "seconds": 0.2, "count": 1},
           "worker_id": "old", "pool": "decode", "host": "h", "ts": 5.0, "active": 1,
           "inflight": 1, "engine_pid": 7}  # fmt: skip
    rep = HeartbeatReport.decode(json.dumps(old))
    assert (rep.worker_id, rep.pool, rep.active, rep.engine_pid) == ("old", "decode", 1, 7)
    assert rep.stats.blocks_used == 3 and rep.stats.prompt_tokens_seen == 0
    assert rep.stats.step_samples == [] and rep.stats.decode_kv_tokens == 0
    assert rep.stats.kvbm is None and rep.stats.images is None
    assert rep.stats.kv_transfer == TransferTotals("nixl", 10, 0.2, 1, failed=0)


def test_a_newer_workers_fields_are_passed_over() -> None:
    new = json.loads(_full().encode())
    new["some_future_counter"] = 5
    new["kvbm"]["g4_blocks"] = 1
    new["images"]["video_frames"] = 3
    assert HeartbeatReport.decode(json.dumps(new)) == _full()


def test_an_expired_report_stands_in_with_its_id_and_pool() -> None:
    rep = HeartbeatReport.decode(None, "prefill", "gone")
    assert rep == HeartbeatReport("gone", "prefill")


def test_the_stats_cross_the_engine_pipe_whole() -> None:
    st = _full().stats
    assert pickle.loads(pickle.dumps(st)) == st
