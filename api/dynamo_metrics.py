"""NVIDIA Dynamo's frontend metric names on ``/metrics``, beside Conveyor's and vLLM's, so
the dashboards, alerts and planner queries written for a Dynamo deployment
(``dynamo_frontend_requests_total``, ``dynamo_frontend_time_to_first_token_seconds``,
``dynamo_frontend_input_sequence_tokens``...) read a Conveyor deployment unchanged.

Made at scrape time, as vLLM's are (:mod:`api.vllm_metrics`): the API's histograms,
counters and gauges under Dynamo's names with its ``model`` label (Conveyor's buckets),
its request counter regrouped as Dynamo counts it (inference endpoints only; ``status``
``success`` / ``error`` and an ``error_type`` from the HTTP status), and the model's
gauges from the settings and the live workers' heartbeats. Dynamo's series that have no
counterpart here (its stage timings, ``request_type``, ``queued_requests``, per-request
``cached_tokens``) are left out rather than made up.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from api.vllm_metrics import renamed
from cluster.membership import HeartbeatReport

P = "dynamo_frontend_"
# the API's metric -> Dynamo's (a counter's name without its _total)
RENAMED = {
    "conveyor_time_to_first_token_seconds": P + "time_to_first_token_seconds",
    "conveyor_inter_token_latency_seconds": P + "inter_token_latency_seconds",
    "conveyor_request_latency_seconds": P + "request_duration_seconds",
    "conveyor_input_sequence_tokens": P + "input_sequence_tokens",
    "conveyor_output_sequence_tokens": P + "output_sequence_tokens",
    "conveyor_completion_tokens": P + "output_tokens",
    "conveyor_requests_in_flight": P + "inflight_requests",
    "conveyor_requests_cancelled": P + "model_cancellation",
}
# inference endpoints, as Dynamo's endpoint label names them
ENDPOINTS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
# generation pools: the model is ready while one of them has a live worker
SERVING_POOLS = ("generate", "decode")


def error_type(status: int) -> str:
    """Dynamo's error_type for an HTTP status ("" for a success)."""
    if status < 400:
        return ""
    known = {404: "not_found", 429: "overload", 529: "overload", 499: "cancelled",
             501: "not_implemented", 503: "unavailable", 504: "response_timeout"}  # fmt: skip
    return known.get(status, "validation" if status < 500 else "internal")


def dynamo_families(exported: Iterable[Metric], workers: list[HeartbeatReport], model: str,
                    limits: dict[str, int]) -> Iterator[Metric]:  # fmt: skip
    """Dynamo's families for the families ``/metrics`` exports, the live workers' reports
    and the model's ``limits`` (context_length, kv_cache_block_size, max_num_seqs,
    max_num_batched_tokens, migration_limit)."""
    label = {"model": model}
    for fam in exported:
        if fam.name in RENAMED:
            yield renamed(fam, RENAMED[fam.name], {}, label)
        elif fam.name == "conveyor_requests":
            yield _requests(fam, model)
        elif fam.name in ("conveyor_requests_refused", "conveyor_migrations"):
            moved = fam.name == "conveyor_migrations"
            c = CounterMetricFamily(P + ("model_migration" if moved else "model_rejection"),
                                    "Requests moved to another worker after theirs died"
                                    if moved else "Requests refused for want of capacity",
                                    labels=["model"])  # fmt: skip
            counted = [s for s in fam.samples if s.name.endswith("_total")
                       and (not moved or s.labels.get("outcome") == "moved")]  # fmt: skip
            c.add_metric([model], sum(s.value for s in counted))
            yield c
    yield from _model(workers, model, limits)


def _requests(fam: Metric, model: str) -> Metric:
    """Conveyor's requests by path and HTTP status as Dynamo's requests_total."""
    counts: dict[tuple[str, str, str], float] = {}
    for s in fam.samples:
        endpoint = ENDPOINTS.get(s.labels.get("endpoint", ""))
        if endpoint is None or not s.name.endswith("_total"):
            continue
        kind = error_type(int(s.labels.get("status", "500")))
        key = (endpoint, "error" if kind else "success", kind)
        counts[key] = counts.get(key, 0.0) + s.value
    c = CounterMetricFamily(P + "requests", "LLM requests processed, by endpoint and outcome",
                            labels=["model", "endpoint", "status", "error_type"])  # fmt: skip
    for (endpoint, status, kind), n in sorted(counts.items()):
        c.add_metric([model, endpoint, status, kind], n)
    return c


def _model(workers: list[HeartbeatReport], model: str, limits: dict[str, int]) -> Iterator[Metric]:
    """The model's gauges: its limits, its KV blocks over the live engine workers, and
    whether a generation worker is live to serve it."""
    for key, value in limits.items():
        g = GaugeMetricFamily(P + "model_" + key, f"The model's {key}", labels=["model"])
        g.add_metric([model], value)
        yield g
    blocks = GaugeMetricFamily(P + "model_total_kv_blocks", "KV blocks of the live workers",
                               labels=["model"])  # fmt: skip
    blocks.add_metric([model], sum(w.stats.blocks_total for w in workers))
    yield blocks
    ready = GaugeMetricFamily(P + "model_ready", "1 while a live worker can serve the model",
                              labels=["model"])  # fmt: skip
    ready.add_metric([model], float(any(w.pool in SERVING_POOLS for w in workers)))
    yield ready
