"""``n > 1`` through the real pipeline (real redis-server, ``conveyor worker`` processes,
the API over HTTP, the official openai client): n choices streamed and not, for chat and
completions, indexed 0..n-1 with the prompt counted once in usage; seeded choices
reproduce and differ; greedy choices all equal the n=1 output; the worker computes the
prompt once (its heartbeat's counters); a client gone mid-stream frees every choice; a
worker killed mid-stream hands both choices of an n=2 stream on; P/D gives agg's choices."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.keys import worker_key
from tests.integration.conftest import (
    Cluster,
    Proc,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.integration.test_errors_and_cancel import slow  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

N = 3


def _fresh(tag: str) -> str:
    """A prompt no worker has cached (its blocks are computed, not found)."""
    return f"{tag} {uuid.uuid4().hex} tell me a story about the sea and the ships on it"


def _report(cluster: Cluster, worker: str) -> dict:
    return json.loads(redis.Redis.from_url(cluster.redis_url).get(worker_key("generate", worker)))


def _settled(cluster: Cluster, worker: str) -> dict:
    """The worker's report once it is idle and a later heartbeat shows the same counters
    (a report lags its engine by a heartbeat: the last test's work must be in it)."""
    keys = ("prompt_tokens_seen", "prompt_tokens_computed", "running", "waiting")
    last: dict = {}
    for _ in range(30):
        rep = _report(cluster, worker)
        if rep["running"] == rep["waiting"] == 0 and all(rep[k] == last.get(k) for k in keys):
            return rep
        last = rep
        time.sleep(1.1)  # two heartbeats (0.5 s)
    raise AssertionError(f"{worker} never settled: {last}")


def _metric(url: str, name: str) -> float:
    """A sample's value on /metrics (``name`` with its labels as exposed); 0 if absent."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.split(" ", 1)[0] == name:
            return float(line.split()[-1])
    return 0.0


def _stream_texts(chunks: list, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """Per choice index: its text and its finish reason, from a stream's chunks; and the
    chunks with usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = []
    for ch in chunks:
        if ch.usage is not None:
            usage.append(ch)
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, f"choice {c.index} finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


# ----------------------------------------------------------------------------------------
# The shape of the response: chat and completions, streamed and not
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_streamed_and_not(cluster: Cluster, chat: bool) -> None:
    """n=3 at temperature 1: three indexed choices in both shapes; the usage counts the
    prompt once and the three choices' tokens; a streamed request gets one [DONE] after
    every choice finished, its usage chunk last."""
    client = cluster.client(max_retries=0, timeout=120)
    prompt = _fresh("shape")
    common = dict(model=cluster.model_name, max_tokens=12, n=N, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})  # fmt: skip
    one = dict(common, n=1, seed=None, temperature=0)
    streamed = dict(common, stream=True, stream_options={"include_usage": True})
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        full = client.chat.completions.create(messages=msgs, **common)
        texts = [c.message.content for c in full.choices]
        alone = client.chat.completions.create(messages=msgs, **one)
        chunks = list(client.chat.completions.create(messages=msgs, **streamed))
    else:
        full = client.completions.create(prompt=prompt, **common)
        texts = [c.text for c in full.choices]
        alone = client.completions.create(prompt=prompt, **one)
        chunks = list(client.completions.create(prompt=prompt, **streamed))
    assert [c.index for c in full.choices] == list(range(N))
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt once
    assert full.usage.completion_tokens == N * 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + N * 12
    got, reasons, usage = _stream_texts(chunks, chat)
    assert sorted(got) == list(range(N)) and reasons == dict.fromkeys(range(N), "length")
    # the same seed: the stream's choices are the body's, choice by choice
    assert [got[i] for i in range(N)] == texts
    assert len(usage) == 1 and chunks[-1] is usage[0] and not usage[0].choices
    assert usage[0].usage.prompt_tokens == full.usage.prompt_tokens
    assert usage[0].usage.completion_tokens == N * 12


def test_seeded_choices_reproduce_and_differ(cluster: Cluster) -> None:
    """A seeded request gives the same n choices twice; they differ from each other; its
    first choice is what the same request with n=1 gives (choice 0 keeps the seed)."""
    client = cluster.client(max_retries=0, timeout=120)
    kw = dict(model=cluster.model_name, prompt="The ships on the sea", max_tokens=16,
              temperature=0.9, seed=1234, extra_body={"ignore_eos": True})  # fmt: skip
    a = [c.text for c in client.completions.create(n=4, **kw).choices]
    b = [c.text for c in client.completions.create(n=4, **kw).choices]
    assert a == b
    assert len(set(a)) == 4, a
    assert client.completions.create(n=1, **kw).choices[0].text == a[0]


def test_greedy_choices_equal_the_single_greedy_output(cluster: Cluster) -> None:
    """Greedy: every choice is the n=1 output, token for token (streamed too)."""
    client = cluster.client(max_retries=0, timeout=120)
    kw = dict(model=cluster.model_name, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    prompt = [1] + [5 + (i * 37) % 507 for i in range(40)]  # 41 tokens: a partial block
    want = client.completions.create(prompt=prompt, **kw).choices[0].text
    got = client.completions.create(prompt=prompt, n=4, **kw)
    assert [c.text for c in got.choices] == [want] * 4
    texts, _, _ = _stream_texts(list(client.completions.create(prompt=prompt, n=4, stream=True,
                                                                **kw)), chat=False)  # fmt: skip
    assert [texts[i] for i in range(4)] == [want] * 4


def test_the_worker_computes_the_prompt_once(cluster: Cluster) -> None:
    """Pinned to one worker, a fresh prompt with n=3: the worker's counters (its heartbeat
    report) grow by the prompt's tokens once: seen, and run through the model."""
    worker = "itest-w0"
    client = cluster.client(max_retries=0, timeout=120)
    before = _settled(cluster, worker)
    out = client.completions.create(model=cluster.model_name, prompt=_fresh("once"), n=N,
                                    max_tokens=8, temperature=0.7,
                                    extra_body={"worker_id": worker})  # fmt: skip
    n_prompt = out.usage.prompt_tokens
    assert n_prompt > 16  # several blocks, a partial last one
    after = _settled(cluster, worker)
    assert after["prompt_tokens_seen"] - before["prompt_tokens_seen"] == n_prompt
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == n_prompt
    assert after["blocks_used"] == 0 and after["running"] == after["waiting"] == 0


def test_n_counts_as_n_requests_on_the_router(cluster: Cluster) -> None:
    """While an n=3 request runs its worker counts 3 requests; all given back at its end."""
    r = redis.Redis.from_url(cluster.redis_url)
    client = cluster.client(max_retries=0, timeout=120)
    stream = client.completions.create(model=cluster.model_name, prompt=_fresh("count"), n=N,
                                       max_tokens=300, stream=True, temperature=0.5,
                                       extra_body={"ignore_eos": True,
                                                   "worker_id": "itest-w1"})  # fmt: skip
    seen = []
    for i, _ in enumerate(stream):
        if i == 5:
            seen.append(int(r.hget("conveyor:load:generate", "itest-w1:reqs") or 0))
    assert seen == [N]
    wait_for(lambda: int(r.hget("conveyor:load:generate", "itest-w1:reqs") or 0) == 0, 5,
             "the requests given back")  # fmt: skip


# ----------------------------------------------------------------------------------------
# A client gone mid-stream: every choice is cancelled (the mock engine, slow steps: the
# deployment test_errors_and_cancel.py cancels a request of one on)
# ----------------------------------------------------------------------------------------
def _counts(cluster: Cluster) -> dict[str, int]:
    """The deployment's workers' counts, summed."""
    keys = ("blocks_used", "running", "waiting")
    return {k: sum(int(w[k]) for w in cluster.worker_loads().values()) for k in keys}


def test_a_client_gone_mid_stream_frees_every_choice(slow: Cluster) -> None:  # noqa: F811
    def used() -> int:
        return _counts(slow)["blocks_used"]

    wait_for(lambda: used() == 0, 30, "an idle worker", slow.workers)
    cancelled = _metric(slow.url, "conveyor_requests_cancelled_total")
    body = {"model": slow.model_name, "prompt": "Once upon a time", "max_tokens": 1500,
            "n": N, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    indexes = set()
    with httpx.stream("POST", f"{slow.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                event = json.loads(line.removeprefix("data:"))
                indexes.update(c["index"] for c in event["choices"])
            if indexes == set(range(N)):
                break
        request_id = event["id"]
        wait_for(lambda: _counts(slow)["running"] == N, 10, "the choices running")
    # the client is gone: each of the n runs would hold its blocks ~28 s more
    wait_for(lambda: used() == 0, 10, "blocks freed by the cancel", slow.workers)
    assert _counts(slow)["running"] == _counts(slow)["waiting"] == 0
    assert _metric(slow.url, "conveyor_requests_cancelled_total") == cancelled + 1
    # the worker's account of the request: aborted, its choices far short of 3 x 1500
    log = slow.workers[0].log
    pattern = rf"\[{request_id}\] abort: \d+ prompt \+ (\d+) output tokens"
    wait_for(lambda: re.search(pattern, log.read_text()), 10, "the worker's log line")
    assert int(re.search(pattern, log.read_text())[1]) < 1000


# ----------------------------------------------------------------------------------------
# A worker killed mid-stream: each choice moves on alone and completes
# ----------------------------------------------------------------------------------------
MIG_TOKENS = 600  # long enough that both choices are mid-stream at the kill


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 77}])
def test_a_killed_worker_hands_both_choices_on(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, sampling: dict
) -> None:
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir)
    workers = [start_worker(f"nmig{i}", "generate", f"nmig{i}", env, tmp_path) for i in range(2)]
    procs: list[Proc] = list(workers)
    model = tiny_model_dir.name
    try:
        with stop_on_error(*workers):
            api, url = start_api("nmig-api", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"]["generate"] == 2, 90,
                 "two workers", procs)  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model=model, prompt="Stream of two: tell me a story", max_tokens=MIG_TOKENS,
                  n=2, extra_body={"ignore_eos": True, "worker_id": "nmig0"},
                  **sampling)  # fmt: skip
        want = [c.text for c in client.completions.create(**kw).choices]  # uninterrupted
        stream = client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kw)  # fmt: skip
        chunks, killed = [], None
        for ch in stream:
            chunks.append(ch)
            if killed is None and {c.index for c in ch.choices} == {1}:  # both under way
                killed = _stream_texts(chunks, chat=False)
                os.kill(workers[0].popen.pid, signal.SIGKILL)
        assert killed is not None and not killed[1], "a choice ended before the kill"
        texts, reasons, usage = _stream_texts(chunks, chat=False)
        assert [texts[0], texts[1]] == want
        assert reasons == {0: "length", 1: "length"}
        assert usage[0].usage.completion_tokens == 2 * MIG_TOKENS
        moved = _metric(url, 'conveyor_migrations_total{outcome="moved",pool="generate"}')
        assert moved == 2, moved  # each choice, alone
        alive = [p for p in procs if p is not workers[0]]
        wait_for(lambda: json.loads(r.get(worker_key("generate", "nmig1")))["blocks_used"] == 0,
                 15, "the survivor's blocks freed", alive)  # fmt: skip
    finally:
        for p in procs:
            p.stop()
        r.flushdb()


# ----------------------------------------------------------------------------------------
# P/D: a request of choices runs on the decode worker, prefilled once there
# ----------------------------------------------------------------------------------------
def test_disagg_gives_agg_s_choices(
    cluster: Cluster, fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    pre = start_worker("nd-prefill", "prefill", "nd-p", env, tmp_path)
    dec = start_worker("nd-decode", "decode", "nd-d", env, tmp_path)
    procs = [pre, dec]
    try:
        with stop_on_error(pre, dec):
            api, url = start_api("nd-api", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"] == {"prefill": 1,
                                                                         "decode": 1},
                 90, "P/D workers", procs)  # fmt: skip
        kw = dict(model=tiny_model_dir.name, max_tokens=20, temperature=0, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
        pd = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        for prompt in ("Once upon a time in P/D", [1] + [7 + i % 300 for i in range(70)]):
            want = [
                c.text for c in cluster.client().completions.create(prompt=prompt, **kw).choices
            ]
            got = [c.text for c in pd.completions.create(prompt=prompt, **kw).choices]
            assert got == want
            assert len(set(want)) == 1
        fell_back = _metric(url, 'conveyor_disagg_fallbacks_total{reason="n_choices"}')
        assert fell_back == 2
    finally:
        for p in procs:
            p.stop()


def test_choices_each_follow_the_requests_json_schema(cluster: Cluster) -> None:
    """Every choice has its own grammar state: n sampled choices under one json_schema each
    validate, streamed and not, and differ (seeded, temperature 1)."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": _fresh("json")}]
    client = cluster.client()
    out = client.chat.completions.create(model=cluster.model_name, messages=msgs, n=N, seed=7,
                                         temperature=1.0, max_tokens=64, response_format=fmt)  # type: ignore[arg-type]  # fmt: skip
    texts = [c.message.content or "" for c in sorted(out.choices, key=lambda c: c.index)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1, texts
    streamed = [""] * N
    for chunk in client.chat.completions.create(model=cluster.model_name, messages=msgs, n=N,
                                                seed=7, temperature=1.0, max_tokens=64,
                                                response_format=fmt, stream=True):  # type: ignore[arg-type]  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts  # seeded: the same choices, streamed


def test_every_choice_carries_its_own_logprobs(cluster: Cluster) -> None:
    """logprobs with n > 1: each choice's entries are its own tokens (their strings join
    into its text), streamed equal to not; completions' echo puts the prompt, with its
    logprobs, before every choice."""
    client, msgs = cluster.client(), [{"role": "user", "content": _fresh("lp")}]
    kw = dict(model=cluster.model_name, messages=msgs, n=N, seed=3, temperature=1.0,
              max_tokens=12, logprobs=True, top_logprobs=2)  # fmt: skip
    out = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    whole = {}
    for c in out.choices:
        entries = c.logprobs.content
        assert len(entries) == 12 and all(len(e.top_logprobs) == 2 for e in entries)
        # a token's string is its own text, as vLLM gives it: U+FFFD where the token ends
        # inside a UTF-8 character, so the strings join into the text up to the first such
        joined = "".join(e.token for e in entries)
        cut = joined.find("\ufffd")
        if cut < 0:
            assert joined == c.message.content
        else:
            assert c.message.content.startswith(joined[:cut]), (joined, c.message.content)
        whole[c.index] = [(e.token, e.logprob) for e in entries]
    assert len({tuple(v) for v in whole.values()}) > 1  # seeded choices differ
    streamed: dict[int, list] = {i: [] for i in range(N)}
    for chunk in client.chat.completions.create(**kw, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed[c.index] += [(e.token, e.logprob) for e in c.logprobs.content]
    # the same tokens; logprobs equal up to float noise (a different batch shape can move
    # the last digit of a float32 log-softmax)
    assert {i: [t for t, _ in v] for i, v in streamed.items()} == {
        i: [t for t, _ in v] for i, v in whole.items()
    }
    for i, v in whole.items():
        assert [lp for _, lp in streamed[i]] == pytest.approx([lp for _, lp in v], abs=1e-3)
    prompt = _fresh("echo")
    done = client.completions.create(model=cluster.model_name, prompt=prompt, n=2, seed=3,
                                     temperature=1.0, max_tokens=5, echo=True,
                                     logprobs=1)  # fmt: skip
    assert done.usage is not None
    for c in done.choices:
        assert c.text.startswith(prompt)
        assert c.logprobs.token_logprobs[0] is None  # the echoed prompt's first token
        assert len(c.logprobs.tokens) == done.usage.prompt_tokens + 5
