"""Cluster-wide metrics, read from Redis at scrape time.

The planner, while one runs, keeps its state there too (``conveyor_planner_*``). Workers
report their state in their heartbeats (KV blocks in use and pinned, requests,
KV transfer totals, the KVBM tiers' occupancy and counters); queue depths are the lengths
of the Celery queues in Redis, for the queues :mod:`tasks.queues` shows (as Flower's
broker page and ``conveyor queues`` do). The ``/metrics`` handler takes one snapshot per
scrape (``refresh``) and this collector turns it into Prometheus families, so any API
replica exports the same cluster view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import redis.asyncio as aioredis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cluster.keys import load_key, planner_state_key
from cluster.ledger import parse_loads
from cluster.membership import HeartbeatReport
from cluster.queues import PoolQueues, aqueue_depths
from cluster.stats import ImageCounters, TransferTotals
from planner.metrics import families as planner_families
from planner.metrics import parse_state
from tasks.modes import Mode
from tasks.queues import POOLS, shown
from tasks.router import Router


class ClusterCollector:
    def __init__(self, mode: Mode) -> None:
        self.pools = mode.pools
        self.mode = mode
        self._workers: list[HeartbeatReport] = []
        self._depths: list[PoolQueues] = []  # the queues tasks.queues shows, with depths
        self._loads: dict[str, dict[str, dict[str, int]]] = {}  # pool -> worker -> counts
        self._router: dict[str, dict[str, float]] = {}  # pool -> this API's router stats
        self._planner: dict | None = None  # the planner's state, while one runs

    async def refresh(self, client: aioredis.Redis, router: Router) -> None:
        self._router = router.stats()
        workers: list[HeartbeatReport] = []
        for pool in self.pools:
            workers += [w.report for w in await router.membership.live_workers(pool)]
        depths = shown(await aqueue_depths(client, POOLS), self.mode)
        pipe = client.pipeline(transaction=False)
        for pool in self.pools:
            pipe.hgetall(load_key(pool))
        pipe.get(planner_state_key())
        *res, planner = await pipe.execute()
        self._planner = parse_state(planner)
        live = {(w.pool, w.worker_id) for w in workers}
        self._loads = {
            pool: {w: c for w, c in parse_loads(raw).items() if (pool, w) in live}
            for pool, raw in zip(self.pools, res, strict=True)
        }
        self._workers = workers
        self._depths = depths

    @property
    def workers(self) -> list[HeartbeatReport]:
        """The live workers' reports, as of the last :meth:`refresh`."""
        return self._workers

    def collect(self) -> Iterator[Metric]:
        yield from self._queue_depths()
        yield from planner_families(self._planner)
        live = GaugeMetricFamily("conveyor_workers_live", "Live workers per pool", labels=["pool"])
        for pool in self.pools:
            live.add_metric([pool], sum(w.pool == pool for w in self._workers))
        yield live
        used = GaugeMetricFamily("conveyor_worker_kv_blocks_used", "KV blocks in use",
                                 labels=["pool", "worker"])  # fmt: skip
        pinned = GaugeMetricFamily("conveyor_worker_kv_blocks_pinned",
                                   "Prefilled requests whose KV awaits a pull",
                                   labels=["pool", "worker"])  # fmt: skip
        active = GaugeMetricFamily("conveyor_worker_active_requests",
                                   "Requests running or waiting in the engine",
                                   labels=["pool", "worker"])  # fmt: skip
        kv_moved = _transfer_families("kv_transfer", "KV")
        frames = CounterMetricFamily(
            "conveyor_worker_frames_published",
            "Token frames a worker published",
            labels=["pool", "worker"],
        )
        frame_errors = CounterMetricFamily("conveyor_worker_frame_publish_errors",
                                           "Frame batches a worker failed to publish",
                                           labels=["pool", "worker"])  # fmt: skip
        # speculative decoding (vLLM's spec_decode_* counters); acceptance rate =
        # accepted / draft tokens
        spec = [(CounterMetricFamily(f"conveyor_spec_decode_{name}", doc,
                                     labels=["pool", "worker"]), attr)
                for name, doc, attr in _SPEC_COUNTERS]  # fmt: skip
        for w in self._workers:
            key, st = [w.pool, w.worker_id], w.stats
            for fam, attr in spec:
                fam.add_metric(key, getattr(st, attr))
            frames.add_metric(key, st.frames_published)
            frame_errors.add_metric(key, st.frame_publish_errors)
            used.add_metric(key, float(st.blocks_used))
            pinned.add_metric(key, float(st.blocks_pinned))
            active.add_metric(key, float(w.active))
            _add_transfer(kv_moved, w.worker_id, st.kv_transfer)
        yield from (used, pinned, active, frames, frame_errors, *kv_moved.values())
        yield from (fam for fam, _ in spec)
        yield from self._kvbm()
        yield from self._routing()
        yield from self._images()

    def _images(self) -> Iterator[Metric]:
        """The vision side of each worker that has one: images through its tower, its
        embedding cache, and embeddings moved between workers."""
        lab = ["pool", "worker"]
        fams: list[tuple[CounterMetricFamily | GaugeMetricFamily, _Get]] = [
            *((CounterMetricFamily(n, d, labels=lab), get) for n, d, get in _IMAGE_COUNTERS),
            *((GaugeMetricFamily(n, d, labels=lab), get) for n, d, get in _IMAGE_GAUGES),
        ]
        moved = _transfer_families("embedding_transfer", "image embedding")
        for w in self._workers:
            images = w.stats.images
            if images is not None:
                for fam, get in fams:
                    fam.add_metric([w.pool, w.worker_id], float(get(images)))
            _add_transfer(moved, w.worker_id, w.stats.embedding_transfer)
        yield from (fam for fam, _ in fams)
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
            key = [w.pool, w.worker_id]
            occupancy.add_metric([*key, "g1"], float(w.stats.blocks_cached))
            capacity.add_metric([*key, "g1"], float(w.stats.blocks_total))
            kv = w.stats.kvbm
            if kv is None:
                continue
            for tier, used, total in (
                ("g2", kv.host_blocks_used, kv.host_blocks_total),
                ("g3", kv.disk_blocks_used, kv.disk_blocks_total),
            ):
                if total:
                    occupancy.add_metric([*key, tier], used)
                    capacity.add_metric([*key, tier], total)
            for tier, n in kv.matched_tokens.items():
                matched.add_metric([*key, tier], n)
            for (kind, d), fam in blocks.items():
                fam.add_metric(key, (kv.offload_blocks if kind == "offload"
                                     else kv.onboard_blocks).get(d, 0))  # fmt: skip
            for kind, fam in nbytes.items():
                for d, n in (kv.offload_bytes if kind == "offload" else kv.onboard_bytes).items():
                    fam.add_metric([*key, d], n)
            if kv.host_blocks_total and kv.lookup_blocks:
                host_hit.add_metric(key, kv.host_hit_blocks / kv.lookup_blocks)
            if kv.disk_blocks_total and kv.disk_lookup_blocks:
                disk_hit.add_metric(key, kv.disk_hit_blocks / kv.disk_lookup_blocks)
            failures.add_metric(key, kv.onboard_failures)
            write_errors.add_metric(key, kv.disk_write_errors)
            bounds, counts = kv.onboard_latency_buckets, kv.onboard_latency_counts
            if bounds and counts and len(counts) == len(bounds) + 1:
                cum, buckets = 0, []
                for b, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                    cum += n
                    buckets.append((b, cum))
                latency.add_metric(key, buckets, kv.onboard_latency_sum)
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
            seen = w.stats.prompt_tokens_seen
            if seen:
                hit.add_metric([w.pool, w.worker_id], w.stats.prompt_tokens_cached / seen)
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


_SPEC_COUNTERS = (
    ("num_drafts", "Decode steps of a sequence that checked drafts", "spec_drafts"),
    ("num_draft_tokens", "Draft tokens proposed", "spec_draft_tokens"),
    ("num_accepted_tokens", "Draft tokens the model accepted", "spec_accepted_tokens"),
)


def _transfer_families(name: str, what: str) -> dict[str, CounterMetricFamily]:
    """One kind of transfer's totals by backend and worker: bytes, seconds and pulls."""
    lab = ["backend", "worker"]
    return {
        "bytes": CounterMetricFamily(f"conveyor_{name}_bytes", f"{what} bytes pulled", labels=lab),
        "seconds": CounterMetricFamily(f"conveyor_{name}_seconds", f"Seconds pulling {what}",
                                       labels=lab),
        "count": CounterMetricFamily(f"conveyor_{name}s", f"{what} pulls", labels=lab),
    }  # fmt: skip


def _add_transfer(
    fams: dict[str, CounterMetricFamily], worker_id: str, t: TransferTotals | None
) -> None:
    """A worker's heartbeat totals of one transfer kind, if it has any."""
    if t is not None:
        key = [t.backend, worker_id]
        fams["bytes"].add_metric(key, t.bytes)
        fams["seconds"].add_metric(key, t.seconds)
        fams["count"].add_metric(key, t.count)


_Get = Callable[[ImageCounters], float]
# the vision side's counters and gauges: (name, help, how to read it)
_IMAGE_COUNTERS: tuple[tuple[str, str, _Get], ...] = (
    ("conveyor_images_encoded", "Images through a worker's vision tower",
     lambda i: i.images_encoded),
    ("conveyor_image_encode_seconds", "Seconds a worker's vision tower spent encoding",
     lambda i: i.encode_seconds),
    ("conveyor_image_encode_batches", "Batches through a worker's vision tower",
     lambda i: i.encode_batches),
    ("conveyor_images_pulled", "Image embeddings a worker pulled from another",
     lambda i: i.images_pulled),
    ("conveyor_image_pull_fallbacks", "Embedding pulls that failed (the worker encoded the image)",
     lambda i: i.pull_fallbacks),
    ("conveyor_embedding_cache_hits", "Images found in a worker's embedding cache",
     lambda i: i.cache_hits),
    ("conveyor_embedding_cache_misses", "Images not in a worker's embedding cache",
     lambda i: i.cache_misses),
    ("conveyor_embedding_cache_evictions", "Embeddings dropped from a worker's cache to make room",
     lambda i: i.cache_evictions),
)  # fmt: skip
_IMAGE_GAUGES: tuple[tuple[str, str, _Get], ...] = (
    ("conveyor_embedding_cache_bytes", "Bytes of embeddings a worker's cache holds",
     lambda i: i.cache_bytes),
    ("conveyor_embedding_cache_entries", "Embeddings a worker's cache holds",
     lambda i: i.cache_entries),
)  # fmt: skip
