"""Cluster-wide metrics, read from Redis at scrape time.

Workers report their state in their heartbeats (KV blocks in use and pinned, requests,
KV transfer totals, the KVBM tiers' occupancy and counters); queue depths are the lengths
of the Celery queues in Redis, for the queues :mod:`tasks.queues` shows (as Flower's
broker page and ``conveyor queues`` do). The ``/metrics`` handler takes one snapshot per
scrape (``refresh``) and this collector turns it into Prometheus families, so any API
replica exports the same cluster view.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis.asyncio as aioredis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cluster.keys import load_key
from cluster.ledger import parse_loads
from cluster.queues import PoolQueues, aqueue_depths
from tasks.modes import Mode
from tasks.queues import POOLS, shown
from tasks.router import Router


class ClusterCollector:
    def __init__(self, mode: Mode) -> None:
        self.pools = mode.pools
        self.mode = mode
        self._workers: list[dict] = []
        self._depths: list[PoolQueues] = []  # the queues tasks.queues shows, with depths
        self._loads: dict[str, dict[str, dict[str, int]]] = {}  # pool -> worker -> counts
        self._router: dict[str, dict[str, float]] = {}  # pool -> this API's router stats

    async def refresh(self, client: aioredis.Redis, router: Router) -> None:
        self._router = router.stats()
        workers: list[dict] = []
        for pool in self.pools:
            for w in await router.membership.live_workers(pool):
                workers.append(w.report.flat())  # HeartbeatReport's fields and the counters
        depths = shown(await aqueue_depths(client, POOLS), self.mode)
        pipe = client.pipeline(transaction=False)
        for pool in self.pools:
            pipe.hgetall(load_key(pool))
        res = await pipe.execute()
        live = {(w.get("pool"), w.get("worker_id")) for w in workers}
        self._loads = {
            pool: {w: c for w, c in parse_loads(raw).items() if (pool, w) in live}
            for pool, raw in zip(self.pools, res, strict=True)
        }
        self._workers = workers
        self._depths = depths

    def collect(self) -> Iterator[Metric]:
        yield from self._queue_depths()
        live = GaugeMetricFamily("conveyor_workers_live", "Live workers per pool", labels=["pool"])
        for pool in self.pools:
            live.add_metric([pool], sum(w.get("pool") == pool for w in self._workers))
        yield live
        fams = {
            "blocks_used": GaugeMetricFamily("conveyor_worker_kv_blocks_used",
                                             "KV blocks in use", labels=["pool", "worker"]),
            "blocks_pinned": GaugeMetricFamily("conveyor_worker_kv_blocks_pinned",
                                               "Prefilled requests whose KV awaits a pull",
                                               labels=["pool", "worker"]),
            "active": GaugeMetricFamily("conveyor_worker_active_requests",
                                        "Requests running or waiting in the engine",
                                        labels=["pool", "worker"]),
        }  # fmt: skip
        kv_moved = _transfer_families("kv_transfer", "KV")
        frames = CounterMetricFamily(
            "conveyor_worker_frames_published",
            "Token frames a worker published",
            labels=["pool", "worker"],
        )
        frame_errors = CounterMetricFamily("conveyor_worker_frame_publish_errors",
                                           "Frame batches a worker failed to publish",
                                           labels=["pool", "worker"])  # fmt: skip
        for w in self._workers:
            key = [w.get("pool", "?"), w.get("worker_id", "?")]
            frames.add_metric(key, w.get("frames_published", 0))
            frame_errors.add_metric(key, w.get("frame_publish_errors", 0))
            for field, fam in fams.items():
                fam.add_metric(key, float(w.get(field, 0)))
            _add_transfer(kv_moved, w, "kv_transfer")
        yield from fams.values()
        yield from (frames, frame_errors, *kv_moved.values())
        yield from self._kvbm()
        yield from self._routing()
        yield from self._images()

    def _images(self) -> Iterator[Metric]:
        """The vision side of each worker that has one: images through its tower, its
        embedding cache, and embeddings moved between workers."""
        counters = {
            "images_encoded": ("conveyor_images_encoded", "Images through a worker's vision tower"),
            "encode_seconds": ("conveyor_image_encode_seconds",
                               "Seconds a worker's vision tower spent encoding"),
            "encode_batches": ("conveyor_image_encode_batches",
                               "Batches through a worker's vision tower"),
            "images_pulled": ("conveyor_images_pulled",
                              "Image embeddings a worker pulled from another"),
            "pull_fallbacks": ("conveyor_image_pull_fallbacks",
                               "Embedding pulls that failed (the worker encoded the image)"),
            "cache_hits": ("conveyor_embedding_cache_hits",
                           "Images found in a worker's embedding cache"),
            "cache_misses": ("conveyor_embedding_cache_misses",
                             "Images not in a worker's embedding cache"),
            "cache_evictions": ("conveyor_embedding_cache_evictions",
                                "Embeddings dropped from a worker's cache to make room"),
        }  # fmt: skip
        gauges = {
            "cache_bytes": ("conveyor_embedding_cache_bytes",
                            "Bytes of embeddings a worker's cache holds"),
            "cache_entries": ("conveyor_embedding_cache_entries",
                              "Embeddings a worker's cache holds"),
        }  # fmt: skip
        fams: dict[str, Metric] = {
            **{k: CounterMetricFamily(n, d, labels=["pool", "worker"])
               for k, (n, d) in counters.items()},
            **{k: GaugeMetricFamily(n, d, labels=["pool", "worker"])
               for k, (n, d) in gauges.items()},
        }  # fmt: skip
        moved = _transfer_families("embedding_transfer", "image embedding")
        for w in self._workers:
            st = w.get("images")
            if st:
                for k, fam in fams.items():
                    key = [w.get("pool", "?"), w.get("worker_id", "?")]
                    fam.add_metric(key, float(st.get(k, 0)))  # type: ignore[attr-defined]
            _add_transfer(moved, w, "embedding_transfer")
        yield from fams.values()
        yield from moved.values()

    def _kvbm(self) -> Iterator[Metric]:
        """The KVBM tiers of each worker (its heartbeat's ``kvbm`` report), under the names
        Dynamo's KVBM exports (``kvbm_*``), prefixed like every Conveyor metric."""
        lab = ["pool", "worker"]
        matched = CounterMetricFamily("conveyor_kvbm_matched_tokens",
                                      "Prompt tokens found cached, by the tier they came from",
                                      labels=[*lab, "tier"])  # fmt: skip
        moves = {
            ("offload", "d2h"): "KV blocks offloaded from the engine pool to host memory",
            ("offload", "h2d"): "KV blocks offloaded from host memory to disk",
            ("offload", "d2d"): "KV blocks offloaded from the engine pool to disk",
            ("onboard", "h2d"): "KV blocks onboarded from host memory into the engine pool",
            ("onboard", "d2d"): "KV blocks onboarded from disk into the engine pool",
        }
        blocks = {k: CounterMetricFamily(f"conveyor_kvbm_{k[0]}_blocks_{k[1]}", doc, labels=lab)
                  for k, doc in moves.items()}  # fmt: skip
        nbytes = {
            d: CounterMetricFamily(f"conveyor_kvbm_{d}_bytes", f"KV bytes {d}ed, by direction",
                                   labels=[*lab, "direction"])
            for d in ("offload", "onboard")
        }  # fmt: skip
        host_hit = GaugeMetricFamily(
            "conveyor_kvbm_host_cache_hit_rate",
            "Prompt blocks missed in the engine pool and found in host memory / those "
            "looked for there",
            labels=lab,
        )
        disk_hit = GaugeMetricFamily(
            "conveyor_kvbm_disk_cache_hit_rate",
            "Prompt blocks missed in the engine pool and host memory and found on disk / "
            "those looked for there",
            labels=lab,
        )
        failures = CounterMetricFamily("conveyor_kvbm_onboard_failures",
                                       "Disk blocks that did not read back intact (recomputed)",
                                       labels=lab)  # fmt: skip
        write_errors = CounterMetricFamily(
            "conveyor_kvbm_disk_write_errors", "Disk blocks that could not be written", labels=lab
        )
        latency = HistogramMetricFamily("conveyor_kvbm_onboard_latency_seconds",
                                        "A request's wait for its blocks from host memory or "
                                        "disk", labels=lab)  # fmt: skip
        occupancy = GaugeMetricFamily("conveyor_kvbm_blocks", "KV blocks held, per tier",
                                      labels=[*lab, "tier"])  # fmt: skip
        capacity = GaugeMetricFamily("conveyor_kvbm_capacity_blocks", "KV blocks a tier holds "
                                     "at most", labels=[*lab, "tier"])  # fmt: skip
        for w in self._workers:
            key = [w.get("pool", "?"), w.get("worker_id", "?")]
            occupancy.add_metric([*key, "g1"], float(w.get("blocks_cached", 0)))
            capacity.add_metric([*key, "g1"], float(w.get("blocks_total", 0)))
            kv = w.get("kvbm") or {}
            if not kv:
                continue
            for tier, name in (("g2", "host"), ("g3", "disk")):
                if kv.get(f"{name}_blocks_total"):
                    occupancy.add_metric([*key, tier], kv.get(f"{name}_blocks_used", 0))
                    capacity.add_metric([*key, tier], kv[f"{name}_blocks_total"])
            for tier, n in (kv.get("matched_tokens") or {}).items():
                matched.add_metric([*key, tier], n)
            for (kind, d), fam in blocks.items():
                fam.add_metric(key, (kv.get(f"{kind}_blocks") or {}).get(d, 0))
            for kind, fam in nbytes.items():
                for d, n in (kv.get(f"{kind}_bytes") or {}).items():
                    fam.add_metric([*key, d], n)
            if kv.get("host_blocks_total") and kv.get("lookup_blocks"):
                host_hit.add_metric(key, kv["host_hit_blocks"] / kv["lookup_blocks"])
            if kv.get("disk_blocks_total") and kv.get("disk_lookup_blocks"):
                disk_hit.add_metric(key, kv["disk_hit_blocks"] / kv["disk_lookup_blocks"])
            failures.add_metric(key, kv.get("onboard_failures", 0))
            write_errors.add_metric(key, kv.get("disk_write_errors", 0))
            bounds, counts = kv.get("onboard_latency_buckets"), kv.get("onboard_latency_counts")
            if bounds and counts and len(counts) == len(bounds) + 1:
                cum, buckets = 0, []
                for b, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                    cum += n
                    buckets.append((b, cum))
                latency.add_metric(key, buckets, kv.get("onboard_latency_sum", 0.0))
        yield from (matched, *blocks.values(), *nbytes.values(), host_hit, disk_hit, failures,
                    write_errors, latency, occupancy, capacity)  # fmt: skip

    def _queue_depths(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("conveyor_queue_depth", "Tasks waiting in a Celery queue",
                                  labels=["queue"])  # fmt: skip
        per_pool = GaugeMetricFamily(
            "conveyor_queue_depth_pool",
            "Tasks waiting for a stage: its pool's shared queue plus its workers' own queues",
            labels=["pool"],
        )
        per_worker = GaugeMetricFamily(
            "conveyor_queue_depth_worker",
            "Tasks waiting in a worker's own queue (a departed worker's until it is empty)",
            labels=["pool", "worker"],
        )
        for p in self._depths:
            per_pool.add_metric([p.pool], p.total)
            for q, n in p.queues.items():
                depth.add_metric([q], n)
            for w in p.workers:
                per_worker.add_metric([p.pool, w.worker_id], w.depth)
        yield from (depth, per_pool, per_worker)

    def _routing(self) -> Iterator[Metric]:
        routed = GaugeMetricFamily(
            "conveyor_router_active_blocks",
            "KV blocks of the requests the routers sent to a worker and not yet finished "
            "(the load the KV router balances)",
            labels=["pool", "worker"],
        )
        queued = GaugeMetricFamily(
            "conveyor_router_queued_prefill_tokens",
            "Prompt tokens routed to a worker and not prefilled yet",
            labels=["pool", "worker"],
        )
        for pool, workers in sorted(self._loads.items()):
            for wid, counts in sorted(workers.items()):
                routed.add_metric([pool, wid], counts.get("blocks", 0))
                queued.add_metric([pool, wid], counts.get("prefill", 0))
        hit = GaugeMetricFamily(
            "conveyor_worker_prefix_cache_hit_rate",
            "Prompt tokens served from the worker's prefix cache / prompt tokens it admitted",
            labels=["pool", "worker"],
        )
        for w in self._workers:
            seen = w.get("prompt_tokens_seen", 0)
            if seen:
                hit.add_metric([w.get("pool", "?"), w.get("worker_id", "?")],
                               w.get("prompt_tokens_cached", 0) / seen)  # fmt: skip
        yield from (routed, queued, hit)
        yield from self._router_index()

    def _router_index(self) -> Iterator[Metric]:
        """This API process's router: its local KV index per pool and how it keeps up."""
        gauges = {
            "index_blocks": ("conveyor_router_index_blocks",
                             "Distinct KV blocks in this API process's local index"),
            "index_workers": ("conveyor_router_index_workers",
                              "Workers with blocks in this API process's local index"),
            "event_lag_seconds": ("conveyor_router_event_lag_seconds",
                                  "Age of the last KV event batch when this API applied it"),
        }  # fmt: skip
        counters = {
            "snapshot_loads": ("conveyor_router_snapshot_loads",
                               "Whole-index snapshots this API process loaded"),
            "worker_reloads": ("conveyor_router_worker_reloads",
                               "Workers reloaded after their event batches skipped numbers"),
            "events_applied": ("conveyor_router_events_applied",
                               "KV event stream entries this API process applied"),
            "commit_conflicts": ("conveyor_router_commit_conflicts",
                                 "Picks refused at commit (worker dead or past the guard)"),
            "leases_reclaimed": ("conveyor_router_leases_reclaimed",
                                 "API processes gone whose counted load this one gave back"),
            "requests_reclaimed": ("conveyor_router_requests_reclaimed",
                                   "Requests counted by API processes gone, given back here"),
        }  # fmt: skip
        for key, (name, doc) in gauges.items():
            fam = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, st in sorted(self._router.items()):
                fam.add_metric([pool], st[key])
            yield fam
        for key, (name, doc) in counters.items():
            cfam = CounterMetricFamily(name, doc, labels=["pool"])
            for pool, st in sorted(self._router.items()):
                cfam.add_metric([pool], st[key])
            yield cfam


def _transfer_families(name: str, what: str) -> dict[str, CounterMetricFamily]:
    """One kind of transfer's totals by backend and worker: bytes, seconds and pulls."""
    lab = ["backend", "worker"]
    return {
        "bytes": CounterMetricFamily(f"conveyor_{name}_bytes", f"{what} bytes pulled", labels=lab),
        "seconds": CounterMetricFamily(f"conveyor_{name}_seconds", f"Seconds pulling {what}",
                                       labels=lab),
        "count": CounterMetricFamily(f"conveyor_{name}s", f"{what} pulls", labels=lab),
    }  # fmt: skip


def _add_transfer(fams: dict[str, CounterMetricFamily], worker: dict, field: str) -> None:
    """A worker's heartbeat totals of one transfer kind (``worker[field]``), if it has any."""
    t = worker.get(field)
    if t:
        for k, fam in fams.items():
            fam.add_metric([t["backend"], worker.get("worker_id", "?")], t.get(k, 0))
