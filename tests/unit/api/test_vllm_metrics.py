"""vLLM's metric names made from the API's families and the workers' heartbeats
(api/vllm_metrics.py), read back by prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import ApiMetrics
from api.vllm_metrics import vllm_families
from cluster.membership import HeartbeatReport
from cluster.stats import EngineStats


class _Families:
    def __init__(self, fams: list) -> None:
        self.fams = fams

    def collect(self) -> list:
        return self.fams


def test_renamed_and_per_worker() -> None:
    m = ApiMetrics()
    m.prompt_tokens.inc(12)
    m.completion_tokens.inc(5)
    m.finish.labels("length").inc()
    m.ttft.observe(0.03)
    workers = [
        HeartbeatReport("w0", "generate", stats=EngineStats(running=2, waiting=1, blocks_used=3,
                        blocks_total=12, prompt_tokens_seen=40, prompt_tokens_cached=16)),
        HeartbeatReport("w1", "generate", stats=EngineStats(preemptions=4)),  # no blocks yet
    ]  # fmt: skip
    fams = list(m.registry.collect())
    text = generate_latest(_Families(list(vllm_families(fams, workers, "tiny")))).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    model = ("model_name", "tiny")
    assert got[("vllm:prompt_tokens_total", (model,))] == 12
    assert got[("vllm:generation_tokens_total", (model,))] == 5
    assert got[("vllm:request_success_total", (("finished_reason", "length"), model))] == 1
    assert got[("vllm:time_to_first_token_seconds_count", (model,))] == 1
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"), model))] == 1
    w0 = (model, ("pool", "generate"), ("worker", "w0"))
    w1 = (model, ("pool", "generate"), ("worker", "w1"))
    assert got[("vllm:num_requests_running", w0)] == 2
    assert got[("vllm:num_requests_waiting", w0)] == 1
    assert got[("vllm:kv_cache_usage_perc", w0)] == 0.25
    assert got[("vllm:kv_cache_usage_perc", w1)] == 0.0
    assert got[("vllm:prefix_cache_hits_total", w0)] == 16
    assert got[("vllm:prefix_cache_queries_total", w0)] == 40
    assert got[("vllm:num_preemptions_total", w1)] == 4
    assert not any(name.startswith("conveyor_") for name, _ in got)  # only vLLM's names


def test_dynamo_names() -> None:
    """Dynamo's frontend names (api/dynamo_metrics.py): the API's families renamed with
    Dynamo's model label, its requests regrouped by endpoint and outcome, the model's
    gauges; read back by prometheus_client's parser."""
    from api.dynamo_metrics import dynamo_families

    m = ApiMetrics()
    m.completion_tokens.inc(5)
    m.observe_lengths(12, 5)
    m.ttft.observe(0.03)
    m.in_flight.inc(2)
    for path, status in (("/v1/chat/completions", "200"), ("/v1/chat/completions", "200"),
                         ("/v1/chat/completions", "400"), ("/v1/completions", "404"),
                         ("/v1/completions", "503"), ("/v1/models", "200")):  # fmt: skip
        m.requests.labels(path, status).inc()
    m.refused.labels("workers_busy").inc(3)
    m.migrations.labels("generate", "moved").inc(2)
    m.migrations.labels("generate", "no_worker").inc()
    workers = [HeartbeatReport("w0", "prefill", stats=EngineStats(blocks_total=10)),
               HeartbeatReport("w1", "decode", stats=EngineStats(blocks_total=12))]  # fmt: skip
    limits = {"context_length": 2048, "kv_cache_block_size": 16, "max_num_seqs": 64,
              "max_num_batched_tokens": 512, "migration_limit": 3}  # fmt: skip
    fams = list(dynamo_families(list(m.registry.collect()), workers, "tiny", limits))
    text = generate_latest(_Families(fams)).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    model = (("model", "tiny"),)
    p = "dynamo_frontend_"
    assert got[(p + "output_tokens_total", model)] == 5
    assert got[(p + "input_sequence_tokens_sum", model)] == 12
    assert got[(p + "output_sequence_tokens_count", model)] == 1
    assert got[(p + "time_to_first_token_seconds_count", model)] == 1
    assert got[(p + "inflight_requests", model)] == 2
    requests = {dict(lab)["endpoint"] + ":" + dict(lab)["error_type"]: v
                for (n, lab), v in got.items() if n == p + "requests_total"}  # fmt: skip
    assert requests == {"chat_completions:": 2, "chat_completions:validation": 1,
                        "completions:not_found": 1, "completions:unavailable": 1}  # fmt: skip
    assert got[(p + "model_rejection_total", model)] == 3
    assert got[(p + "model_migration_total", model)] == 2
    assert got[(p + "model_context_length", model)] == 2048
    assert got[(p + "model_total_kv_blocks", model)] == 22
    assert got[(p + "model_ready", model)] == 1
    none = list(dynamo_families([], workers[:1], "tiny", {}))  # a prefill worker alone
    assert [f.samples[0].value for f in none if f.name == p + "model_ready"] == [0]
    assert all(name.startswith(p) for name, _ in got)  # only Dynamo's names
