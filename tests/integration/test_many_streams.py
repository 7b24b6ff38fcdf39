"""1,000 concurrent SSE streams through one API process (real redis-server, two real
mock-engine workers, real HTTP): every stream completes with all its tokens, the API's
RSS after is within 1.2x of before, and the inter-token gap the clients saw is printed
(p50 / p99; docs/performance.md, "API: 1,000 concurrent streams").

The streams are read by ``bench/sse_client.py`` (an asyncio protocol on uvloop: the
client shares the machine's cores with the server), 20 more at the same time by the
official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import (
    base_env,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from sse_client import SSEClient, run_loop  # noqa: E402

pytestmark = pytest.mark.integration

STREAMS = 1000
OPENAI_STREAMS = 20
TOKENS = 32
WORKERS = 2
PER_WORKER = (STREAMS + OPENAI_STREAMS) // WORKERS + 10


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _raise_nofile(n: int) -> None:
    """Room for the streams' sockets here and in the API (it inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 3 * STREAMS, "ulimit -n too low"


LEAN_PROMPT, OFFICIAL_PROMPT = "many streams", "many streams, official"


async def _streams(url: str, model: str, n: int, with_openai: int) -> tuple[list, list]:
    body = {"model": model, "prompt": LEAN_PROMPT, "max_tokens": TOKENS, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180,
                             http_client=None)  # fmt: skip

    async def official() -> str:
        out = []
        stream = await oai.completions.create(model=model, prompt=OFFICIAL_PROMPT,
                                              max_tokens=TOKENS, stream=True,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        async for chunk in stream:
            out += [c.text for c in chunk.choices if c.text]
        return "".join(out)

    async with SSEClient(url, max_connections=n, timeout_s=180) as client:
        lean = [client.stream("/v1/completions", body) for _ in range(n)]
        results = await asyncio.gather(*lean, *(official() for _ in range(with_openai)),
                                       return_exceptions=True)  # fmt: skip
    await oai.close()
    return list(results[:n]), list(results[n:])


def _unstreamed(url: str, model: str, prompt: str) -> str:
    """The text of ``prompt``'s completion, not streamed: exactly TOKENS tokens."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    out = c.completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                               extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == TOKENS
    return out.choices[0].text


def test_a_thousand_concurrent_streams_complete_on_one_api_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _raise_nofile(4 * STREAMS + 1000)
    rproc, rurl = start_redis(tmp_path, "--maxclients", "10000")
    env = base_env(rurl, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_WORKER_CONCURRENCY=str(PER_WORKER),
                   CONVEYOR_MAX_NUM_SEQS=str(PER_WORKER), CONVEYOR_NUM_KV_BLOCKS="4096",
                   CONVEYOR_WORKER_MAX_REQUESTS="0", CONVEYOR_MOCK__DECODE_STEP_MS="200",
                   CONVEYOR_MOCK__DECODE_MS_PER_SEQ="0.02")  # fmt: skip
    procs = [rproc]
    try:
        with stop_on_error(*procs):
            procs += [start_worker(f"many-w{i}", "generate", f"many-w{i}", env, tmp_path)
                      for i in range(WORKERS)]  # fmt: skip
            api, url = start_api("many-api", env, tmp_path)
            procs.append(api)
            wait_for(lambda: httpx.get(f"{url}/health", timeout=1).json()["workers"]
                     ["generate"] == WORKERS, 60, "live workers", procs)  # fmt: skip
        model = tiny_model_dir.name
        # Warm-up at full size. The first burst leaves ~40 MiB of free pools in Python's
        # small-object allocator, held by a few objects that outlive it (its allocated
        # bytes are back where they were): a high-water mark, reached once
        # (docs/performance.md, "API: 1,000 concurrent streams"). What must not happen is
        # growth from one burst to the next.
        started = _rss_kb(api.popen.pid)
        run_loop(_streams(url, model, 50, 2))  # the API's first requests: code paths warm
        warm = run_loop(_streams(url, model, STREAMS, OPENAI_STREAMS))
        assert not [r for r in warm[0] + warm[1] if isinstance(r, BaseException)]
        time.sleep(5.0)  # the idle trim
        before = _rss_kb(api.popen.pid)
        t0 = time.monotonic()
        lean, official = run_loop(_streams(url, model, STREAMS, OPENAI_STREAMS))
        took = time.monotonic() - t0
        failed = [r for r in lean + official if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} streams failed, first: {failed[0]!r}"
        # every stream carries all its tokens: the text of the same request unstreamed
        # (the mock engine's tokens depend on the prompt only), and its usage says TOKENS
        want = {p: _unstreamed(url, model, p) for p in (LEAN_PROMPT, OFFICIAL_PROMPT)}
        gaps: list[float] = []
        for events in lean:
            chunks = [e for _, e in events if e["choices"]]
            assert "".join(e["choices"][0]["text"] for e in chunks) == want[LEAN_PROMPT]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
            assert events[-1][1]["usage"]["completion_tokens"] == TOKENS, events[-1]
            stamps = [t for t, e in events if e["choices"] and e["choices"][0]["text"]]
            gaps += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert official == [want[OFFICIAL_PROMPT]] * OPENAI_STREAMS, official[:2]
        time.sleep(5.0)  # the clean-ups of the last streams, the idle trim
        after = _rss_kb(api.popen.pid)
        q = statistics.quantiles(gaps, n=100)
        print(f"\n{STREAMS} + {OPENAI_STREAMS} concurrent streams x {TOKENS} tokens in "
              f"{took:.1f} s; inter-chunk gap p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} "
              f"ms (max {max(gaps) * 1e3:.0f} ms, {len(gaps)} gaps); API RSS {before / 1024:.0f}"
              f" -> {after / 1024:.0f} MiB (at start: {started / 1024:.0f} MiB)")  # fmt: skip
        m = httpx.get(f"{url}/metrics", timeout=5).text
        assert "conveyor_requests_in_flight 0.0" in m
        assert after <= 1.2 * before, (before, after)
    finally:
        for p in reversed(procs):
            p.stop()
