"""The OpenAI checks again, through the stock path (``CONVEYOR_BROKER_FASTPATH=false``):
kombu's own Redis transport, Celery's own consumer and task strategy, redis-py's clients
for the API's routing, sends and pub/sub and for the workers' frames.

The checks are :mod:`tests.integration.test_openai_api`'s own functions, collected here a
second time against this module's ``cluster``: an isolated deployment (its own Redis
database, workers and API) with the fast path off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.integration.test_openai_api import (  # noqa: F401 - collected again here
    hf,
    test_32_concurrent_streams_lose_nothing,
    test_a_stream_ends_with_one_chunk,
    test_chat_stream_equals_nonstream_and_hf,
    test_completion_matches_hf_generate,
    test_max_completion_tokens_and_stream_without_usage,
    test_models_health_metrics_docs,
    test_repeated_prompt_reports_cached_tokens,
    test_seed_reproducible,
    test_stop_strings,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("stock-logs")
    url = redis_dbs.take(__name__)
    env = base_env(url, tiny_model_dir, CONVEYOR_BROKER_FASTPATH="false")
    workers = [start_worker(f"stock{i}", "generate", f"itest-w{i}", env, logdir) for i in range(2)]
    with stop_on_error(*workers):
        api, api_url = start_api("stock-api", env, logdir)
    c = Cluster(api_url, url, tiny_model_dir, tiny_model_dir.name, workers, api)
    with stop_on_error(*workers, api):
        wait_for(
            lambda: httpx.get(f"{api_url}/health", timeout=1).json()["workers"]["generate"] == 2,
            90,
            "2 live workers",
            [*workers, api],
        )
    yield c
    for p in [api, *workers]:
        p.stop()


def test_the_stock_path_is_the_one_serving(cluster: Cluster) -> None:
    """The API says so at start, and no request starts on receipt (the fast path's Celery
    strategy): each reaches the engine when its task runs."""
    c = cluster.client()
    # ignore_eos: sampled at the default temperature, a request may end before 3 tokens
    outs = [c.completions.create(model=cluster.model_name, prompt=f"stock {i}", max_tokens=3,
                                 extra_body={"ignore_eos": True})
            for i in range(4)]  # fmt: skip
    assert all(o.usage.completion_tokens == 3 for o in outs)
    assert "fast path off" in cluster.api.log.read_text()

    def logged() -> list[str]:
        lines = [line for w in cluster.workers for line in w.log.read_text().splitlines()
                 if any(o.id in line and "output tokens" in line for o in outs)]  # fmt: skip
        return lines if len(lines) == len(outs) else []

    wait_for(logged, 10, "the worker's log lines for the requests", cluster.workers)
    assert not any("begun on receipt" in line for line in logged())
