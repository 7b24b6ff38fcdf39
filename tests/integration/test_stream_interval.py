"""A worker with a stream interval (``CONVEYOR_STREAM_INTERVAL=4``, vLLM's
``--stream-interval``) through the real API and the official client: the same text as
without one, in about a quarter of the chunks.

Besides this module's own check, the OpenAI checks a changed frame size could break
(streamed against non-streamed text, stop strings, the stream's end, streamed logprobs)
are collected again against this module's ``cluster``: its own Redis database, one
worker (``itest-w0``, the logprobs check's) and an API.
"""

from __future__ import annotations

import math
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
from tests.integration.test_logprobs import (  # noqa: F401 - collected again here
    test_streamed_chat_logprobs_reassemble_to_the_non_streamed,
)
from tests.integration.test_openai_api import (  # noqa: F401 - collected again here
    hf,
    test_a_stream_ends_with_one_chunk,
    test_chat_stream_equals_nonstream_and_hf,
    test_stop_strings,
)

pytestmark = pytest.mark.integration

INTERVAL = 4


@pytest.fixture(scope="module")
def cluster(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("interval-logs")
    url = redis_dbs.take(__name__)
    env = base_env(url, tiny_model_dir, CONVEYOR_STREAM_INTERVAL=str(INTERVAL))
    worker = start_worker("interval-w0", "generate", "itest-w0", env, logdir)
    with stop_on_error(worker):
        api, api_url = start_api("interval-api", env, logdir)
    c = Cluster(api_url, url, tiny_model_dir, tiny_model_dir.name, [worker], api)
    with stop_on_error(worker, api):
        wait_for(
            lambda: httpx.get(f"{api_url}/health", timeout=1).json()["workers"]["generate"] == 1,
            90,
            "1 live worker",
            [worker, api],
        )
    yield c
    for p in [api, worker]:
        p.stop()


@pytest.mark.parametrize("n", [1, 2, 5, 24, 31])
def test_a_streamed_chat_comes_in_a_chunk_per_interval_with_the_same_text(
    cluster: Cluster, n: int
) -> None:
    c = cluster.client()
    kw = dict(model=cluster.model_name, max_tokens=n, temperature=0,
              messages=[{"role": "user", "content": f"Count to {n}, slowly."}],
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = c.chat.completions.create(**kw)
    assert whole.usage.completion_tokens == n
    frames = 1 + math.ceil((n - 1) / INTERVAL)  # the first token's, then one per INTERVAL
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    assert "".join(d or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # a chunk per frame at most: fewer where the API sends frames that came together in
    # one chunk, or holds a frame's text back (a character split across tokens)
    content = [d for d in deltas if d]
    assert 1 <= len(content) <= frames, (len(content), deltas)

    # With logprobs each chunk says how many tokens it carries: whatever the API joins,
    # every chunk but the last ends after the first token plus a multiple of INTERVAL.
    chunks = list(c.chat.completions.create(stream=True, logprobs=True, **kw))
    sizes = [len(ch.choices[0].logprobs.content) for ch in chunks
             if ch.choices and ch.choices[0].logprobs]  # fmt: skip
    assert sum(sizes) == n and len(sizes) <= frames, sizes
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    assert all(e % INTERVAL == 1 % INTERVAL for e in ends), sizes
