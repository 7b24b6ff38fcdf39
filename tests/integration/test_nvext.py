"""A Dynamo client's ``nvext`` through the real pipeline (the session cluster: redis-server,
two ``conveyor worker`` processes, the API over HTTP, the official openai client): the
prompt as ``token_data`` gives the answer of the text it tokenizes to, ``greed_sampling``
the greedy answer, ``backend_instance_id`` and Dynamo's routing headers pin the request
(an unknown worker is the 400 a pin gets); ``extra_fields`` put the workers and timing on
the response, ``annotations`` stream the prompt before the first chunk, and
``session_control`` keeps a session's turns on one worker until it is closed. The P/D
side (a prefill pin, both workers named) is in test_disagg.py."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
import redis

from cluster.keys import session_key
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "Name three rivers."}]


def test_token_data_and_greed_sampling_give_the_plain_answer(cluster: Cluster) -> None:
    c, model = cluster.client(max_retries=0), cluster.model_name
    greedy = c.chat.completions.create(model=model, messages=MSGS, max_tokens=8,  # type: ignore[arg-type]
                                       temperature=0)  # fmt: skip
    ids = httpx.post(f"{cluster.url}/tokenize", json={"model": model, "messages": MSGS}).json()
    nv: dict[str, Any] = {"greed_sampling": True, "token_data": ids["tokens"]}
    other = [{"role": "user", "content": "Something else entirely."}]  # token_data wins
    got = c.chat.completions.create(model=model, messages=other, max_tokens=8,  # type: ignore[arg-type]
                                    temperature=1.3, extra_body={"nvext": nv})  # fmt: skip
    assert got.choices[0].message.content == greedy.choices[0].message.content
    assert got.usage.prompt_tokens == ids["count"]  # type: ignore[union-attr]

    comp = c.completions.create(model=model, prompt="ignored", max_tokens=6, temperature=0,
                                extra_body={"nvext": {"token_data": [1, 72, 301, 44]}})  # fmt: skip
    want = c.completions.create(model=model, prompt=[1, 72, 301, 44], max_tokens=6,
                                temperature=0)  # fmt: skip
    assert comp.choices[0].text == want.choices[0].text


def test_backend_instance_id_pins_the_worker(cluster: Cluster) -> None:
    c, model = cluster.client(max_retries=0), cluster.model_name
    for w in ("itest-w0", "itest-w1"):  # the session cluster's workers
        r = httpx.post(f"{cluster.url}/v1/completions", json={
            "model": model, "prompt": "hi", "max_tokens": 2,
            "nvext": {"backend_instance_id": w}})  # fmt: skip
        assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="hi", max_tokens=2,
                             extra_body={"nvext": {"backend_instance_id": 12345}})  # fmt: skip
    assert e.value.body["code"] == "worker_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="x", max_tokens=2,
                             extra_body={"nvext": {"token_data": [1, 10**9]}})  # fmt: skip
    assert e.value.body["param"] == "nvext.token_data"  # type: ignore[index]


WORKERS = {"itest-w0", "itest-w1"}


def _post(cluster: Cluster, path: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(
        f"{cluster.url}{path}", json={"model": cluster.model_name, **body}, timeout=60, **kw
    )  # type: ignore[arg-type]


def _check_timing(t: dict, before_ms: float, after_ms: float) -> None:
    """Dynamo's TimingInfo, consistent with itself and the client's clock."""
    assert before_ms - 5 <= t["request_received_ms"] <= after_ms + 5, t
    assert 0 <= t["prefill_wait_time_ms"] <= t["ttft_ms"] <= t["total_time_ms"], t
    assert t["prefill_wait_time_ms"] + t["prefill_time_ms"] == pytest.approx(t["ttft_ms"], abs=0.01)
    assert t["total_time_ms"] <= after_ms - t["request_received_ms"] + 5, t
    assert 0.0 <= t["kv_hit_rate"] <= 1.0, t


def test_extra_fields_name_the_worker_and_time_the_request(cluster: Cluster) -> None:
    nv = {"extra_fields": ["worker_id", "timing", "routed_experts"]}  # the last: ignored
    prompt = f"{uuid.uuid4().hex} " * 12  # > 2 blocks of 16 tokens, cached nowhere yet
    for w in sorted(WORKERS):
        seen = []
        for _ in range(2):  # the second finds the first's blocks on the same worker
            before = time.time() * 1000
            r = _post(
                cluster,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 4, "nvext": {**nv, "backend_instance_id": w}},
            )
            after = time.time() * 1000
            assert r.status_code == 200, r.text
            ext = r.json()["nvext"]
            assert ext["worker_id"] == {"prefill_worker_id": w, "decode_worker_id": w}
            assert set(ext) == {"worker_id", "timing"}
            _check_timing(ext["timing"], before, after)
            seen.append(ext["timing"]["kv_hit_rate"])
        assert seen[0] == 0.0 and seen[1] > 0.5, seen  # (its last block is never cached)

    # unasked: no nvext; chat's body too; a stream carries it on its finish chunk only
    assert (
        "nvext" not in _post(cluster, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()
    )
    c = cluster.client(max_retries=0)
    got = c.chat.completions.create(
        model=cluster.model_name,
        messages=MSGS,
        max_tokens=3,  # type: ignore[arg-type]
        extra_body={"nvext": {"extra_fields": ["worker_id"]}},
    )
    worker = got.model_extra["nvext"]["worker_id"]  # type: ignore[index]
    assert worker["prefill_worker_id"] == worker["decode_worker_id"] in WORKERS
    chunks = list(
        c.chat.completions.create(
            model=cluster.model_name,
            messages=MSGS,
            max_tokens=5,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_body={"nvext": {"extra_fields": ["timing", "worker_id"]}},
        )
    )
    carrying = [ch for ch in chunks if (ch.model_extra or {}).get("nvext")]
    assert len(carrying) == 1 and carrying[0].choices[0].finish_reason is not None
    ext = carrying[0].model_extra["nvext"]  # type: ignore[index]
    assert ext["worker_id"]["decode_worker_id"] in WORKERS and ext["timing"]["ttft_ms"] > 0
    # n > 1: each choice's finish chunk
    chunks = list(
        c.completions.create(
            model=cluster.model_name,
            prompt="a b c",
            max_tokens=3,
            n=2,
            stream=True,
            temperature=1.0,
            extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        )
    )
    finishes = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finishes) == 2
    assert all(
        ch.model_extra["nvext"]["worker_id"]["decode_worker_id"] in WORKERS  # type: ignore[index]
        for ch in finishes
    )


def _sse(r: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data or comment) of each SSE event of a whole body, in order."""
    out = []
    for block in r.text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, value = None, ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") or line.startswith(": "):
                value = line[line.index(" ") + 1 :]
        out.append((name, value))
    return out


def test_annotations_stream_the_prompt_before_the_first_chunk(cluster: Cluster) -> None:
    ids = httpx.post(
        f"{cluster.url}/tokenize", json={"model": cluster.model_name, "messages": MSGS}
    ).json()["tokens"]
    nv = {"annotations": ["token_ids", "formatted_prompt", "llm_metrics"]}  # last: ignored
    r = _post(
        cluster,
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 3, "stream": True, "nvext": nv},
    )
    assert r.status_code == 200, r.text
    events = _sse(r)
    assert [name for name, _ in events[:2]] == ["token_ids", "formatted_prompt"]
    assert json.loads(json.loads(events[0][1])) == ids
    prompt = json.loads(events[1][1])
    assert "Name three rivers." in prompt
    assert all(name is None for name, _ in events[2:]) and events[-1][1] == "[DONE]"
    # a completions prompt is its own formatted prompt; a whole response carries none
    r = _post(
        cluster,
        "/v1/completions",
        {
            "prompt": "plain words",
            "max_tokens": 2,
            "stream": True,
            "nvext": {"annotations": ["formatted_prompt"], "use_raw_prompt": True},
        },
    )
    assert "plain words" in json.loads(_sse(r)[0][1])
    whole = _post(
        cluster,
        "/v1/completions",
        {"prompt": "plain words", "max_tokens": 2, "nvext": {"annotations": ["token_ids"]}},
    )
    assert whole.status_code == 200 and "nvext" not in whole.json()
    r = _post(
        cluster,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "nvext": {"annotations": ["query_instance_id:1"]}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "nvext.annotations"


def test_dynamo_routing_headers_pin_the_worker(cluster: Cluster) -> None:
    nv = {"extra_fields": ["worker_id"]}
    for w in sorted(WORKERS):
        for headers in ({"x-worker-instance-id": w}, {"x-prefill-instance-id": w}):
            r = _post(
                cluster,
                "/v1/completions",
                {"prompt": "hi", "max_tokens": 2, "nvext": nv},
                headers=headers,
            )
            assert r.json()["nvext"]["worker_id"]["decode_worker_id"] == w, (headers, r.text)
    # one worker prefills and decodes here: two different ones cannot both be honoured
    r = _post(
        cluster,
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 2,
            "nvext": {"backend_instance_id": "itest-w0", "prefill_worker_id": "itest-w1"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "nvext.prefill_worker_id"


def test_session_control_keeps_a_session_on_its_worker_until_closed(cluster: Cluster) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    sid = f"sess-{uuid.uuid4().hex}"

    def turn(action: str | None, text: str) -> str:
        sc: dict = {"session_id": sid}
        if action:
            sc |= {"action": action, "timeout": 120}
        got = _post(
            cluster,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 2,
                "nvext": {"session_control": sc, "extra_fields": ["worker_id"]},
            },
        )
        assert got.status_code == 200, got.text
        return got.json()["nvext"]["worker_id"]["decode_worker_id"]

    first = turn("open", "the first turn")
    assert 100 < r.ttl(session_key(sid)) <= 120
    # unrelated prompts (nothing cached in common) all go where the session began
    assert {turn(None, f"turn {i}: {uuid.uuid4().hex}") for i in range(6)} == {first}
    assert 100 < r.ttl(session_key(sid)) <= 120  # the open's timeout, renewed
    assert turn("close", "the last turn") == first
    assert not r.exists(session_key(sid))
    # a session whose worker left goes on where routing sends it, and sticks there
    r.hset(session_key(sid), mapping={"decode": "a-worker-long-gone", "timeout": 60})
    now = turn(None, "after the worker left")
    assert now in WORKERS and r.hget(session_key(sid), "decode") == now.encode()
    r.delete(session_key(sid))
    bad = _post(
        cluster,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "nvext": {"session_control": {"action": "open"}}},
    )
    assert bad.status_code == 400 and "session_id" in bad.json()["error"]["param"]


def _decisions(cluster: Cluster) -> float:
    """Workers picked by this API so far (every request, warm-ups too)."""
    lines = httpx.get(f"{cluster.url}/metrics").text.splitlines()
    return sum(float(ln.split()[-1]) for ln in lines
               if ln.startswith("conveyor_routing_decisions_total{"))  # fmt: skip


def test_speculative_prefill_caches_the_next_turns_prefix(cluster: Cluster) -> None:
    history = [{"role": "user", "content": f"{uuid.uuid4().hex} " * 8}]
    hint = {"agent_hints": {"speculative_prefill": True}}
    start = _decisions(cluster)
    plain = _post(cluster, "/v1/chat/completions", {"messages": history, "max_tokens": 2})
    assert plain.status_code == 200 and _decisions(cluster) == start + 1  # no warm-up
    first = _post(cluster, "/v1/chat/completions", {"messages": history, "max_tokens": 8,
                                                     "temperature": 0, "nvext": hint})  # fmt: skip
    answer = first.json()["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 30
    while _decisions(cluster) < start + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _decisions(cluster) == start + 3  # the turn, then its warm-up
    turn = [*history, {"role": "assistant", "content": answer}]
    prefix = httpx.post(f"{cluster.url}/tokenize", json={
        "model": cluster.model_name, "messages": turn, "add_generation_prompt": False,
    }).json()["tokens"]  # fmt: skip
    time.sleep(0.5)  # the warm-up's blocks reach the router's view of the worker
    nxt = _post(cluster, "/v1/chat/completions", {"messages": [
        *turn, {"role": "user", "content": "and then?"}], "max_tokens": 2})  # fmt: skip
    cached = nxt.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(prefix) // 16 * 16, (cached, len(prefix))
