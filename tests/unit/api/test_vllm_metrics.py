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
