"""vLLM's metric names on ``/metrics``, beside Conveyor's own, so dashboards, alerts and
autoscalers written for a vLLM server (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds``...) read a Conveyor
deployment unchanged.

Made at scrape time from what ``/metrics`` exports already, so a request pays nothing for
them: the API's histograms and counters under vLLM's names (their samples as they are,
Conveyor's buckets), and the engine's gauges and counters from each worker's heartbeat
(:class:`api.cluster_metrics.ClusterCollector`), one series per worker. Every series has
vLLM's ``model_name`` label.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from cluster.membership import HeartbeatReport

# the API's metric -> vLLM's, and a label renamed on the way
RENAMED = {
    "conveyor_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", {}),
    "conveyor_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", {}),
    "conveyor_request_latency_seconds": ("vllm:e2e_request_latency_seconds", {}),
    "conveyor_prompt_tokens": ("vllm:prompt_tokens", {}),
    "conveyor_completion_tokens": ("vllm:generation_tokens", {}),
    "conveyor_finish_reasons": ("vllm:request_success", {"reason": "finished_reason"}),
    "conveyor_input_sequence_tokens": ("vllm:request_prompt_tokens", {}),
    "conveyor_output_sequence_tokens": ("vllm:request_generation_tokens", {}),
}


def vllm_families(exported: Iterable[Metric], workers: list[HeartbeatReport],
                  model_name: str) -> Iterator[Metric]:  # fmt: skip
    """vLLM's families for the families ``/metrics`` exports and the live workers'
    reports."""
    for fam in exported:
        if fam.name in RENAMED:
            name, labels = RENAMED[fam.name]
            yield renamed(fam, name, labels, {"model_name": model_name})
    yield from _engine(workers, model_name)


def renamed(fam: Metric, name: str, labels: dict[str, str], extra: dict[str, str]) -> Metric:
    """``fam`` under ``name``: its samples as they are, ``labels`` renamed (old -> new) and
    the ``extra`` labels added."""
    out = Metric(name, fam.documentation, fam.type, fam.unit)
    for s in fam.samples:
        kept = {labels.get(k, k): v for k, v in s.labels.items()}
        out.samples.append(Sample(name + s.name[len(fam.name) :], {**extra, **kept}, s.value,
                                  s.timestamp, s.exemplar))  # fmt: skip
    return out


def _engine(workers: list[HeartbeatReport], model_name: str) -> Iterator[Metric]:
    """The engine's state and counters, per worker (``worker``, ``pool``), from its
    heartbeat."""
    lab = ["model_name", "pool", "worker"]
    gauges = {
        "num_requests_running": "Requests in the engine's running batch",
        "num_requests_waiting": "Requests waiting in the engine's queue",
        "kv_cache_usage_perc": "Fraction of the engine's KV blocks in use (1 = full)",
    }
    counters = {
        "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
        "prefix_cache_hits": "Prompt tokens found in the prefix cache",
        "num_preemptions": "Requests the engine preempted",
        "spec_decode_num_drafts": "Speculative decoding: steps with drafts",
        "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed",
        "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted",
    }
    g = {k: GaugeMetricFamily(f"vllm:{k}", doc, labels=lab) for k, doc in gauges.items()}
    c = {k: CounterMetricFamily(f"vllm:{k}", doc, labels=lab) for k, doc in counters.items()}
    for w in workers:
        s, key = w.stats, [model_name, w.pool, w.worker_id]
        g["num_requests_running"].add_metric(key, s.running)
        g["num_requests_waiting"].add_metric(key, s.waiting)
        g["kv_cache_usage_perc"].add_metric(key, s.blocks_used / s.blocks_total
                                            if s.blocks_total else 0.0)  # fmt: skip
        c["prefix_cache_queries"].add_metric(key, s.prompt_tokens_seen)
        c["prefix_cache_hits"].add_metric(key, s.prompt_tokens_cached)
        c["num_preemptions"].add_metric(key, s.preemptions)
        c["spec_decode_num_drafts"].add_metric(key, s.spec_drafts)
        c["spec_decode_num_draft_tokens"].add_metric(key, s.spec_draft_tokens)
        c["spec_decode_num_accepted_tokens"].add_metric(key, s.spec_accepted_tokens)
    yield from g.values()
    yield from c.values()
