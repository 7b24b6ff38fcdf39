"""Prometheus metrics of the API process (``GET /metrics``).

With several API processes on one port (``CONVEYOR_API_WORKERS``), ``conveyor api`` names
a directory in ``PROMETHEUS_MULTIPROC_DIR`` before they start: each keeps its counters
there (prometheus_client's multiprocess mode) and whichever answers a scrape sums them
all (gauges: the live processes' sum)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from cluster.traffic import TrafficCounter

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# tokens per request: 1, 2, 5, 10, 20, 50, ... up to 131072-token windows (vLLM's scheme)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # the same events, counted for the planner in Redis (cluster.traffic)
        self.traffic = TrafficCounter()
        self.requests = Counter(
            "conveyor_requests", "Requests by endpoint and HTTP status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "conveyor_time_to_first_token_seconds", "Time from request to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "conveyor_inter_token_latency_seconds", "Time between streamed token frames",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "conveyor_request_latency_seconds", "Request duration, end to end",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "conveyor_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.completion_tokens = Counter(
            "conveyor_completion_tokens", "Completion tokens generated", registry=r
        )
        # per generation request, at its end (vLLM's request_prompt_tokens and
        # request_generation_tokens, Dynamo's input and output sequence tokens)
        self.input_tokens = Histogram(
            "conveyor_input_sequence_tokens", "Prompt tokens per generation request",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.output_tokens = Histogram(
            "conveyor_output_sequence_tokens",
            "Completion tokens per generation request (its choices together)",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.embedding_inputs = Counter(
            "conveyor_embedding_inputs", "Inputs embedded (/v1/embeddings: one per vector)",
            registry=r,
        )  # fmt: skip
        self.embedding_tokens = Counter(
            "conveyor_embedding_tokens",
            "Prompt tokens embedded (/v1/embeddings; also in conveyor_prompt_tokens)",
            registry=r,
        )
        self.classification_inputs = Counter(
            "conveyor_classification_inputs",
            "Inputs classified (/classify, /pooling and a cross-encoder's /score and "
            "/rerank: one per input or pair; their tokens count in conveyor_prompt_tokens)",
            registry=r,
        )
        self.in_flight = Gauge(
            "conveyor_requests_in_flight",
            "Requests being served now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cancelled = Counter(
            "conveyor_requests_cancelled", "Requests cancelled by client disconnect", registry=r
        )
        self.redispatched = Counter(
            "conveyor_requests_redispatched",
            "Requests sent again because their worker died before answering",
            registry=r,
        )
        self.migrations = Counter(
            "conveyor_migrations",
            "Streams whose worker died mid-generation: moved on to another worker of the "
            "pool (outcome=moved), or ended for want of one (outcome=no_worker)",
            ["pool", "outcome"],
            registry=r,
        )
        self.disagg_fallbacks = Counter(
            "conveyor_disagg_fallbacks",
            "disagg requests run aggregated on a decode worker, by reason",
            ["reason"],
            registry=r,
        )
        self.finish = Counter(
            "conveyor_finish_reasons", "Finished requests by finish reason", ["reason"],
            registry=r,
        )  # fmt: skip
        self.routing_decisions = Counter(
            "conveyor_routing_decisions",
            "Workers picked, by pool and how (kv, kv_guarded, round_robin, random, pinned)",
            ["pool", "reason"],
            registry=r,
        )
        self.overlap_ratio = Histogram(
            "conveyor_routing_overlap_ratio",
            "Share of the prompt's full blocks the chosen worker already held",
            ["pool"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=r,
        )
        self.routed_prefix_blocks = Counter(
            "conveyor_routing_prefix_blocks",
            "Prompt blocks cached on the chosen worker (of=chosen) and on the best live "
            "worker (of=best), by the index at routing time (kv mode); chosen/best shows "
            "how much cache the load terms traded away",
            ["pool", "of"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "conveyor_routing_decision_seconds",
            "Time one routing decision took in this API process (scoring + the commit)",
            ["pool"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.cached_tokens = Counter(
            "conveyor_prompt_tokens_cached",
            "Prompt tokens served from a worker's prefix cache (hit rate: divide by "
            "conveyor_prompt_tokens)",
            registry=r,
        )

        self.images_received = Counter(
            "conveyor_images_received",
            "Images accepted by the media guard, by source (data: URL or fetched url)",
            ["source"],
            registry=r,
        )
        self.image_fetch_seconds = Histogram(
            "conveyor_image_fetch_seconds",
            "Time to fetch one image URL (DNS, connect, redirects, body)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.image_refusals = Counter(
            "conveyor_image_refusals",
            "Images the media guard refused, by reason (the error's code)",
            ["reason"],
            registry=r,
        )

        # admission (api/admission.py)
        self.refused = Counter(
            "conveyor_requests_refused",
            "Requests refused before any work was queued, by reason (workers_busy: 503, "
            "every worker at its request cap past the admission wait; client_limit: 429)",
            ["reason"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "conveyor_admission_waiting", "Requests waiting for a worker under its cap",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "conveyor_tenant_tokens",
            "Tokens used per API key (the first 16 hex digits of its SHA-256), prompt and "
            "completion; CONVEYOR_TENANT_TOKENS_PER_MIN budgets them per minute",
            ["tenant", "kind"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "conveyor_admission_wait_seconds",
            "Time requests that found every worker at its cap waited (admitted or refused)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def exposed(self, *collectors: object) -> CollectorRegistry:
        """What ``/metrics`` exports: this registry (``collectors`` registered on it
        already), or with several API processes every process's counters summed, and
        ``collectors`` (the cluster's, read from Redis by whichever process answers)."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return self.registry
        out = CollectorRegistry()
        MultiProcessCollector(out)
        for c in collectors:
            out.register(c)  # type: ignore[arg-type]
        return out

    def observe_lengths(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A generation request's sequence lengths, at its end."""
        self.input_tokens.observe(prompt_tokens)
        self.output_tokens.observe(completion_tokens)

    def observe_decision(self, pool: str, seconds: float) -> None:
        self.decision_seconds.labels(pool).observe(seconds)
