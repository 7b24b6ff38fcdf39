"""The OpenAI API through the whole pipeline: openai client -> HTTP -> Celery -> worker
engine -> Redis pub/sub -> SSE. Greedy outputs are checked against Hugging Face
``generate`` on the same checkpoint, so the pipeline is proven to neither lose, duplicate
nor reorder tokens."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import openai
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from cluster.index import KVIndex
from cluster.keys import load_key
from cluster.ledger import parse_loads
from kvbm.protocol import block_hashes, model_namespace
from tests.integration.conftest import Cluster, base_env, start_api, wait_for

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello, world!",
    "Once upon a time there was a small model",
    "The cache holds blocks of sixteen tokens; a prefix that is shared is computed once.",
    "1 2 3",
]


@pytest.fixture(scope="module")
def hf(cluster: Cluster) -> tuple:
    tok = AutoTokenizer.from_pretrained(cluster.model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(cluster.model_dir).eval()
    return tok, model


def hf_greedy(hf: tuple, ids: list[int], n: int) -> list[int]:
    tok, model = hf
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


def greedy_text(hf: tuple, prompt: str, n: int) -> str:
    tok, _ = hf
    ids = tok(prompt).input_ids
    return tok.decode(hf_greedy(hf, ids, n), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------
# Happy paths
# ----------------------------------------------------------------------------------------


def test_models_health_metrics_docs(cluster: Cluster) -> None:
    c = cluster.client()
    assert [m.id for m in c.models.list().data] == [cluster.model_name]
    h = httpx.get(f"{cluster.url}/health").json()
    assert h == {"status": "ok", "redis": "ok", "workers": {"generate": 2}}
    assert httpx.get(f"{cluster.url}/docs").status_code == 200
    spec = httpx.get(f"{cluster.url}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def _total(m: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items()
               if n == name and set(labels.items()) <= set(lab))  # fmt: skip


def test_metrics_under_vllms_names(cluster: Cluster) -> None:
    """/metrics carries vLLM's names beside Conveyor's: the API's counters and histograms
    move with a request as Conveyor's do, and each worker's engine state is there."""
    model = {"model_name": cluster.model_name}
    before = _scrape(cluster.url)
    r = cluster.client().chat.completions.create(
        model=cluster.model_name, messages=[{"role": "user", "content": "metrics?"}],
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    after = _scrape(cluster.url)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert grew("vllm:prompt_tokens_total", **model) == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert grew("vllm:generation_tokens_total", **model) == 5
    assert grew("vllm:request_prompt_tokens_sum", **model) == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert grew("vllm:request_generation_tokens_count", **model) == 1
    assert grew("vllm:request_success_total", finished_reason="length", **model) == 1
    for theirs, ours in (("time_to_first_token_seconds", "time_to_first_token_seconds"),
                         ("e2e_request_latency_seconds", "request_latency_seconds")):  # fmt: skip
        assert grew(f"vllm:{theirs}_count", **model) == grew(f"conveyor_{ours}_count") == 1
    workers = {dict(lab)["worker"] for (n, lab) in after if n == "vllm:num_requests_running"}
    assert workers == {"itest-w0", "itest-w1"}
    usage = [v for (n, _), v in after.items() if n == "vllm:kv_cache_usage_perc"]
    assert len(usage) == 2 and all(0.0 <= u <= 1.0 for u in usage)
    # the engines' prefix-cache counters reach /metrics with their next heartbeat
    wait_for(lambda: _total(_scrape(cluster.url), "vllm:prefix_cache_queries_total")
             - _total(before, "vllm:prefix_cache_queries_total") >= r.usage.prompt_tokens,  # type: ignore[union-attr]
             15, "the prompt counted by the prefix cache")  # fmt: skip


def test_metrics_under_dynamos_names(cluster: Cluster) -> None:
    """/metrics carries Dynamo's frontend names too: a chat request and a refused one move
    Dynamo's request counter by endpoint and outcome, its sequence-length histograms and
    latencies as Conveyor's move; the model's gauges say what serves it."""
    model = {"model": cluster.model_name}
    before = _scrape(cluster.url)
    c = cluster.client(max_retries=0)
    r = c.chat.completions.create(
        model=cluster.model_name, messages=[{"role": "user", "content": "metrics?"}],
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=cluster.model_name, messages=[], max_tokens=5)
    after = _scrape(cluster.url)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    p = "dynamo_frontend_"
    chat = {"endpoint": "chat_completions", **model}
    assert grew(p + "requests_total", status="success", error_type="", **chat) == 1
    assert grew(p + "requests_total", status="error", error_type="validation", **chat) == 1
    assert grew(p + "input_sequence_tokens_sum", **model) == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert grew(p + "output_sequence_tokens_sum", **model) == 5
    assert grew(p + "output_tokens_total", **model) == 5
    for theirs, ours in (("time_to_first_token_seconds", "time_to_first_token_seconds"),
                         ("request_duration_seconds", "request_latency_seconds")):  # fmt: skip
        assert grew(f"{p}{theirs}_count", **model) == grew(f"conveyor_{ours}_count") == 1
    assert _total(after, p + "model_ready", **model) == 1
    assert _total(after, p + "model_total_kv_blocks", **model) > 0
    assert _total(after, p + "model_context_length", **model) > 0


def test_documents_and_a_requests_own_chat_template(
    cluster: Cluster, hf: tuple, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM's documents, chat_template and add_special_tokens on chat: a request's own
    template is a 400 unless the server trusts them (CONVEYOR_TRUST_REQUEST_CHAT_TEMPLATE);
    on one that does, the answer is HF's greedy continuation of HF's render of the
    template with the documents, which /tokenize renders the same."""
    template = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "<assistant>")  # fmt: skip
    docs = [{"title": "KV", "text": "Blocks of sixteen tokens."}]
    msgs = [{"role": "user", "content": "What is cached?"}]
    own = {"chat_template": template, "documents": docs}
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client(max_retries=0).chat.completions.create(
            model=cluster.model_name, messages=msgs, max_tokens=4, extra_body=own)  # type: ignore[arg-type]  # fmt: skip
    assert e.value.body["param"] == "chat_template"  # type: ignore[index]
    trusted = {"CONVEYOR_TRUST_REQUEST_CHAT_TEMPLATE": "true"}
    env = base_env(cluster.redis_url, cluster.model_dir, **trusted)
    api, url = start_api("api-templates", env, tmp_path_factory.mktemp("templates"))
    try:
        tok, _ = hf
        ids = tok.apply_chat_template(msgs, documents=docs, chat_template=template,
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for special in (False, True):
            want = [tok.bos_token_id, *ids] if special else ids
            told = httpx.post(f"{url}/tokenize", json={
                "messages": msgs, "add_special_tokens": special, **own}).json()  # fmt: skip
            assert told["tokens"] == want
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            r = c.chat.completions.create(
                model=cluster.model_name, messages=msgs, max_tokens=6, temperature=0,  # type: ignore[arg-type]
                extra_body={**own, "add_special_tokens": special, "ignore_eos": True})  # fmt: skip
            assert r.usage.prompt_tokens == len(want)  # type: ignore[union-attr]
            assert r.choices[0].message.content == tok.decode(hf_greedy(hf, want, 6),
                                                              skip_special_tokens=True)  # fmt: skip
    finally:
        api.stop()


def test_predicted_outputs(cluster: Cluster, hf: tuple) -> None:
    """OpenAI's ``prediction``: the answer is the greedy answer without it (HF's), drafted
    from the prediction by the reference engine (no speculative config needed), and usage
    says how many of its tokens were accepted and rejected, streamed and not. A prediction
    is text, matched as its tokens: the prompt is one whose greedy output (of the tiny
    random model, which often writes tokens its tokenizer would split otherwise) reads back
    as the same tokens."""
    c = cluster.client()
    msgs = [{"role": "user", "content": "Fix the typo."}]
    ids = hf[0].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    n = 32
    out_ids = hf_greedy(hf, ids, n)
    want = hf[0].decode(out_ids, skip_special_tokens=True)
    assert hf[0].encode(want, add_special_tokens=False) == out_ids  # its text round-trips
    kw = dict(model=cluster.model_name, messages=msgs, max_tokens=n, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    plain = c.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert plain.choices[0].message.content == want
    assert plain.usage.completion_tokens_details is None  # no prediction, no counts
    edited = want[: len(want) // 2] + " EDIT " + want[len(want) // 2 + 3 :]
    for prediction, all_right in ((want, True), (edited, False)):
        r = c.chat.completions.create(prediction={"type": "content", "content": prediction},
                                      **kw)  # type: ignore[call-overload]  # fmt: skip
        assert r.choices[0].message.content == want
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > n / 2, d
        assert (d.rejected_prediction_tokens == 0) == all_right, d
    chunks = list(c.chat.completions.create(
        prediction={"type": "content", "content": [{"type": "text", "text": want}]},
        stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > n / 2
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(prediction={"type": "diff", "content": "x"}, **kw)  # type: ignore[call-overload]
    assert e.value.body["param"] == "prediction.type"  # type: ignore[index]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_hf_generate(cluster: Cluster, hf: tuple, prompt: str) -> None:
    n = 24
    r = cluster.client().completions.create(
        model=cluster.model_name,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == greedy_text(hf, prompt, n)
    assert r.choices[0].finish_reason == "length"
    tok, _ = hf
    assert r.usage.prompt_tokens == len(tok(prompt).input_ids)
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + n


def test_chat_stream_equals_nonstream_and_hf(cluster: Cluster, hf: tuple) -> None:
    tok, _ = hf
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    c = cluster.client()
    n = 30
    full = c.chat.completions.create(
        model=cluster.model_name,
        messages=msgs,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    expected = tok.decode(hf_greedy(hf, list(ids), n), skip_special_tokens=True)
    assert full.choices[0].message.content == expected
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == n

    chunks = list(
        c.chat.completions.create(
            model=cluster.model_name,
            messages=msgs,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == expected
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finals] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_continue_final_message_with_echo(cluster: Cluster, hf: tuple) -> None:
    """vLLM's continue_final_message: the prompt ends inside the assistant's last message
    (HF's template with continue_final_message), and the output continues it, greedy as HF
    generates from that prompt. With echo the content starts with that message, streamed
    (n=2: each choice) and not; without, it is the continuation alone."""
    tok, _ = hf
    client = cluster.client()
    msgs = [{"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": "Once upon a time"}]  # fmt: skip
    body = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    kw = dict(model=cluster.model_name, messages=msgs, max_tokens=8, temperature=0)
    ids = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = tok.decode(hf_greedy(hf, ids, 8), skip_special_tokens=True)
    plain = client.chat.completions.create(extra_body=body, **kw)  # type: ignore[call-overload]
    assert plain.choices[0].message.content == want
    assert plain.usage.prompt_tokens == len(ids)
    echoed = client.chat.completions.create(extra_body={**body, "echo": True},
                                            **kw)  # type: ignore[call-overload]  # fmt: skip
    assert echoed.choices[0].message.content == "Once upon a time" + want
    chunks = list(client.chat.completions.create(extra_body={**body, "echo": True}, n=2,
                                                 stream=True, **kw))  # type: ignore[call-overload]  # fmt: skip
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in (0, 1)}  # fmt: skip
    assert texts == dict.fromkeys((0, 1), "Once upon a time" + want)
    # a last message that is not the assistant's is not echoed (vLLM's rule)
    user_last = client.chat.completions.create(
        model=cluster.model_name, messages=msgs[:1], max_tokens=4, temperature=0,
        extra_body={"echo": True})  # fmt: skip
    assert not user_last.choices[0].message.content.startswith("Tell me")


def test_max_completion_tokens_and_stream_without_usage(cluster: Cluster) -> None:
    c = cluster.client()
    r = c.chat.completions.create(
        model=cluster.model_name,
        messages=[{"role": "user", "content": "count"}],
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 5
    chunks = list(
        c.completions.create(
            model=cluster.model_name,
            prompt="abc",
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(cluster: Cluster, hf: tuple) -> None:
    prompt = PROMPTS[1]
    ref = greedy_text(hf, prompt, 40)
    # a stop string from the middle of the greedy output, first occurring at position k
    k = len(ref) // 2
    stop = ref[k : k + 3]
    k = ref.index(stop)
    assert stop.strip(), f"pick a visible stop string, got {stop!r}"
    c = cluster.client()
    for stream in (False, True):
        kw = dict(
            model=cluster.model_name,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stop=[stop, "never-appears-xyz"],
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(c.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = c.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == ref[:k], (stream, stop)
        assert reason == "stop"


def test_seed_reproducible(cluster: Cluster) -> None:
    c = cluster.client()

    def run(seed: int) -> str:
        r = c.completions.create(
            model=cluster.model_name,
            prompt="Tell me",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    a, b, other = run(1234), run(1234), run(99)
    assert a == b
    assert a != other


async def _stream_text(
    client: openai.AsyncOpenAI, model: str, prompt: str, n: int
) -> tuple[str, str]:
    """The request's id and the text it streamed."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts, rid = [], ""
    async for ch in stream:
        rid = ch.id
        if ch.choices:
            parts.append(ch.choices[0].text)
    return rid, "".join(parts)


def test_32_concurrent_streams_lose_nothing(cluster: Cluster, hf: tuple) -> None:
    n = 16
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(32)]
    expected = {p: greedy_text(hf, p, n) for p in prompts}

    async def main() -> list[tuple[str, str]]:
        client = cluster.async_client(max_retries=0, timeout=120)
        return await asyncio.gather(
            *(_stream_text(client, cluster.model_name, p, n) for p in prompts)
        )

    got = asyncio.run(main())
    mismatched = [p for p, (_, g) in zip(prompts, got, strict=True) if g != expected[p]]
    assert not mismatched, f"{len(mismatched)} streams differ, e.g. {mismatched[0]!r}"
    # each request ran once, on one worker, and the router spread them over both: a
    # worker's queued prompts count against it
    ran: dict[str, list[str]] = {}

    def all_logged() -> bool:
        ran.clear()
        for w in cluster.workers:
            text = w.log.read_text(errors="replace")
            for rid, _ in got:
                ran.setdefault(rid, []).extend([w.name] * text.count(f"[{rid}] length: "))
        return all(ran.values())

    wait_for(all_logged, 10, "the workers' log lines for the requests", cluster.workers)
    assert all(len(where) == 1 for where in ran.values()), ran
    assert {where[0] for where in ran.values()} == {w.name for w in cluster.workers}
    # and once they are over, the load the router counted for them is all given back
    r = redis.Redis.from_url(cluster.redis_url)
    workers = set(cluster.worker_loads())
    assert len(workers) == 2

    def counted() -> dict[str, dict[str, int]]:
        loads = parse_loads(r.hgetall(load_key("generate")))
        return {w: counts for w, counts in loads.items() if w in workers and any(counts.values())}

    wait_for(lambda: counted() == {}, 10, "the router's load counts back at 0")


def test_repeated_prompt_reports_cached_tokens(cluster: Cluster) -> None:
    """A prompt whose prefix a worker has cached is routed to that worker (KV-aware
    routing) and served from those blocks; the usage says how many prompt tokens came
    from the cache (OpenAI's cached_tokens field): none the first time, then the prompt's
    6 full blocks (96 tokens; the last, partial block is computed) every time."""
    c = cluster.client()
    prompt = [1] + [(11 * i) % 500 + 5 for i in range(99)]  # 100 tokens: 6 full blocks
    kw = dict(
        model=cluster.model_name,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = c.completions.create(**kw)
    assert first.usage.prompt_tokens == 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the worker's KV events reach the router's index: one worker holds the 6 blocks
    hashes = block_hashes(prompt, 16, model_namespace(cluster.model_name))
    index = KVIndex(redis.Redis.from_url(cluster.redis_url), "generate")
    wait_for(lambda: 6 in index.overlaps(hashes).values(), 10, "the prompt in the index")
    assert sorted(index.overlaps(hashes).values()) == [0, 6]
    runs = [c.completions.create(**kw) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in runs] == [96, 96]
    assert {r.choices[0].text for r in runs} == {first.choices[0].text}  # a hit, same text
    streams = [
        list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        for _ in range(2)
    ]
    assert [s[-1].usage.prompt_tokens_details.cached_tokens for s in streams] == [96, 96]
    assert sorted(index.overlaps(hashes).values()) == [0, 6]  # never computed elsewhere


def _nice(pid: int) -> set[int]:
    """The niceness of every thread of ``pid``."""
    return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_a_workers_celery_side_runs_nicer_than_its_engine(cluster: Cluster) -> None:
    """CONVEYOR_WORKER_NICE (10): every Celery thread of a worker (pool threads included,
    started after the change) runs at niceness 10; its engine process keeps 0, and it
    still serves (the rest of this module)."""
    worker = cluster.workers[0].popen.pid
    engine = int(cluster.worker_loads()["itest-w0"]["engine_pid"])  # its registry record
    assert engine != worker
    c = cluster.client()
    done = c.completions.create(model=cluster.model_name, prompt="nice", max_tokens=2,
                                extra_body={"ignore_eos": True})  # fmt: skip
    assert done.usage.completion_tokens == 2  # served: the pool's threads exist by now
    assert _nice(worker) == {10}
    assert _nice(engine) == {0}


def test_a_request_starts_in_the_engine_as_its_message_arrives(cluster: Cluster) -> None:
    """tasks.intake: the worker's event loop starts each request in the engine as its
    message arrives, and the task thread Celery runs later waits for that run; the worker
    says so in the request's log line. The request's tokens are those of any other run
    (the greedy tests above went the same way)."""
    c = cluster.client()
    outs = [c.completions.create(model=cluster.model_name, prompt=f"begin {i}", max_tokens=3,
                                 temperature=0) for i in range(4)]  # fmt: skip
    assert all(o.usage.completion_tokens == 3 for o in outs)

    def logged() -> bool:
        lines = [line for w in cluster.workers
                 for line in w.log.read_text(errors="replace").splitlines()]  # fmt: skip
        return all(any(f"[{o.id}]" in line and "tokens in" in line and "(begun on receipt)"
                       in line for line in lines) for o in outs)  # fmt: skip

    wait_for(logged, 10, "the worker's log lines for the requests", cluster.workers)


def test_the_bench_client_reads_what_the_openai_client_reads(cluster: Cluster) -> None:
    """bench/sse_client.py (the serving benchmark's lean client) against the real API: the
    same text and usage as the official client streams for the same greedy request (how
    tokens group into chunks depends on timing: frames that wait are sent as one)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from sse_client import SSEClient, run_loop

    body = dict(model=cluster.model_name, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})  # fmt: skip
    ref = list(
        cluster.client().completions.create(
            model=cluster.model_name,
            prompt=PROMPTS[0],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    )

    async def read() -> list[tuple[float, dict]]:
        async with SSEClient(cluster.url, 2, 60.0) as client:
            assert (await client.get_json("/v1/models"))["data"][0]["id"] == cluster.model_name
            return await client.stream("/v1/completions", body)

    got = run_loop(read())
    texts = [obj["choices"][0]["text"] for _, obj in got if obj["choices"]]
    assert "".join(texts) == "".join(ch.choices[0].text for ch in ref if ch.choices)
    assert got[-2][1]["choices"][0]["finish_reason"] == "length"
    assert got[-1][1]["usage"]["completion_tokens"] == ref[-1].usage.completion_tokens == 24
    times = [t for t, _ in got]
    assert times == sorted(times)


def _http_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """The body of a streamed response as the HTTP chunks the server wrote (h11 on a raw
    socket: each chunk of the chunked encoding as one item)."""
    import json
    import socket
    from urllib.parse import urlsplit

    import h11

    u = urlsplit(url)
    payload = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    chunks: list[bytes] = []
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        headers = [("host", u.netloc), ("content-type", "application/json"),
                   ("content-length", str(len(payload)))]  # fmt: skip
        sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=headers)))
        sock.sendall(conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                if event.chunk_start or not chunks:
                    chunks.append(b"")
                chunks[-1] += event.data
            elif isinstance(event, h11.EndOfMessage):
                return chunks


@pytest.mark.parametrize("usage", [True, False])
def test_a_stream_ends_with_one_chunk(cluster: Cluster, usage: bool) -> None:
    """The finish, the usage (when asked for) and [DONE] reach the client as one HTTP chunk:
    one write and one wake of the client for the end of every stream."""
    body = dict(model=cluster.model_name, prompt="abc", max_tokens=6, temperature=0,
                ignore_eos=True, stream=True, stream_options={"include_usage": usage})  # fmt: skip
    chunks = _http_chunks(cluster.url, "/v1/completions", body)
    last = chunks[-1].decode()
    events = [e for e in last.split("\r\n\r\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in last
    assert ('"completion_tokens":6' in last) == usage
    # every chunk before it is a whole event (or a few), none of them the end
    assert all(c.endswith(b"\r\n\r\n") and b"[DONE]" not in c for c in chunks[:-1])


@pytest.mark.parametrize("kind", ["chat", "completion-batch"])
def test_continuous_usage_stats(cluster: Cluster, kind: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage
    so far (its prompt, its tokens until then), growing by each chunk's tokens to the
    choice's whole count on its finish chunk; the last chunk is the request's usage."""
    client = cluster.client()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"ignore_eos": True, "return_token_ids": True}
    kw = dict(model=cluster.model_name, max_tokens=9, temperature=0, stream=True,
              stream_options=opts, n=2, extra_body=body)  # fmt: skip
    if kind == "chat":
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "Count the waves"}], **kw))  # type: ignore[call-overload]  # fmt: skip
        prompts = {0: chunks[0].model_extra["prompt_token_ids"]}
    else:
        chunks = list(client.completions.create(prompt=["Count", "the waves of the sea"],
                                                **kw))  # type: ignore[call-overload]  # fmt: skip
        prompts = {}
    *body, last = chunks
    choices = 2 if kind == "chat" else 4  # n=2, of one prompt or of two
    assert last.choices == [] and last.usage.completion_tokens == 9 * choices
    seen: dict[int, int] = {}
    for ch in body:
        (c,) = ch.choices
        u = ch.usage
        assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
        ids = (c.model_extra or {}).get("token_ids") or []
        seen[c.index] = seen.get(c.index, 0) + len(ids)
        assert u.completion_tokens == seen[c.index], (c.index, u, seen)
        if c.finish_reason is not None:
            assert u.completion_tokens == 9
        if kind == "chat":
            assert u.prompt_tokens == len(prompts[0])
    assert sorted(seen) == list(range(choices))
    per_prompt = {u.prompt_tokens for ch in body for u in [ch.usage] if ch.choices[0].index < 2}
    assert len(per_prompt) == 1  # a batch's choices each count their own prompt


def test_a_clients_request_id_names_the_response(cluster: Cluster) -> None:
    """vLLM's ``request_id`` (and its ``X-Request-Id`` header, which wins): the response's
    ``id`` is ``chatcmpl-<it>`` / ``cmpl-<it>``, in every chunk and the x-request-id header."""
    client = cluster.client()
    r = client.chat.completions.with_raw_response.create(
        model=cluster.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={"request_id": "trace-42"},
    )  # fmt: skip
    assert r.parse().id == "chatcmpl-trace-42" and r.headers["x-request-id"] == "chatcmpl-trace-42"
    chunks = list(client.completions.create(
        model=cluster.model_name, prompt="hi", max_tokens=3, stream=True,
        extra_body={"request_id": "trace-43"}, extra_headers={"X-Request-Id": "from-header"},
    ))  # fmt: skip
    assert chunks and {c.id for c in chunks} == {"cmpl-from-header"}
    plain = client.completions.create(model=cluster.model_name, prompt="hi", max_tokens=1)
    assert plain.id.startswith("cmpl-") and "trace" not in plain.id
    bad = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": cluster.model_name, "prompt": "hi", "request_id": "has space"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_truncation_side_right_keeps_the_first_tokens(cluster: Cluster) -> None:
    """vLLM's truncation_side: right keeps the first truncate_prompt_tokens tokens, and the
    request runs as if only those were sent (echo repeats them)."""
    client = cluster.client()
    ids = [1, 72, 301, 44, 209, 17, 388, 96]
    kw: dict = dict(model=cluster.model_name, max_tokens=5, temperature=0)
    cut = client.completions.create(prompt=ids, echo=True, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right"}, **kw)  # fmt: skip
    alone = client.completions.create(prompt=ids[:3], echo=True, **kw)
    assert cut.usage.prompt_tokens == 3  # type: ignore[union-attr]
    assert cut.choices[0].text == alone.choices[0].text
    left = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 3}, **kw)
    assert left.choices[0].text == client.completions.create(prompt=ids[-3:], **kw).choices[0].text


def test_add_special_tokens_false_sends_a_text_prompt_without_its_bos(cluster: Cluster) -> None:
    """vLLM's completions add_special_tokens (default true): false tokenizes the text
    alone, as its token ids sent as they are would run."""
    client = cluster.client()
    kw: dict = dict(model=cluster.model_name, max_tokens=5, temperature=0)
    with_bos = client.completions.create(prompt="hi there", **kw)
    bare = client.completions.create(prompt="hi there", extra_body={"add_special_tokens": False},
                                     **kw)  # fmt: skip
    assert bare.usage.prompt_tokens == with_bos.usage.prompt_tokens - 1  # type: ignore[union-attr]
    tok = httpx.post(
        f"{cluster.url}/tokenize",
        json={"model": cluster.model_name, "prompt": "hi there", "add_special_tokens": False},
        timeout=30,
    ).json()
    assert len(tok["tokens"]) == bare.usage.prompt_tokens  # type: ignore[union-attr]
    assert bare.choices[0].text == client.completions.create(prompt=tok["tokens"], **kw)\
        .choices[0].text  # fmt: skip
