"""vLLM's tokens-in, tokens-out surface through the real pipeline (the session cluster:
redis-server, ``conveyor worker`` processes on the reference engine, the API over HTTP):
``/inference/v1/generate`` gives the tokens, logprobs and text the OpenAI endpoints give for
the same prompt and sampling, streamed and not; a rendered chat or completions request sent
to generate gives that request's own answer; ``/abort_requests`` ends a running request
with finish reason ``abort``; bad bodies get 400s that name the field."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Cluster, base_env, start_api

pytestmark = pytest.mark.integration

PROMPT = [1, 72, 301, 44, 209, 17, 388, 96, 150, 263]


def _post(cluster: Cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=60)


def _events(cluster: Cluster, body: dict) -> list[dict | str]:
    """An SSE response's events: each JSON object, and ``[DONE]``."""
    out: list[dict | str] = []
    with httpx.stream("POST", f"{cluster.url}/inference/v1/generate", json=body,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_gives_the_completions_tokens_logprobs_and_text(cluster: Cluster) -> None:
    sp = {"max_tokens": 8, "temperature": 0, "logprobs": 2}
    ref = _post(cluster, "/v1/completions", {
        "model": cluster.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "logprobs": 2, "return_token_ids": True,
    }).json()["choices"][0]  # fmt: skip
    r = _post(cluster, "/inference/v1/generate",
              {"token_ids": PROMPT, "sampling_params": sp, "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_mode"] == "tokens" and body["request_id"].startswith("generate-tokens-")
    assert body["prompt_token_ids"] == PROMPT and body["model"] == cluster.model_name
    (choice,) = body["choices"]
    assert choice["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 8
    assert choice["finish_reason"] == "length" and "text" not in choice
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 8
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == ref["token_ids"]
    assert [c["logprob"] for c in content] == pytest.approx(ref["logprobs"]["token_logprobs"])
    for c in content:  # the sampled token first (greedy: the likeliest), 2 in all
        assert c["top_logprobs"][0]["token_id"] == c["token_id"] and c["rank"] == 1
        assert len(c["top_logprobs"]) == 2
        assert c["top_logprobs"][1]["logprob"] <= c["logprob"]

    text = _post(cluster, "/inference/v1/generate", {
        "token_ids": PROMPT, "sampling_params": sp, "output_mode": "text"}).json()  # fmt: skip
    assert text["output_mode"] == "text"
    assert text["choices"][0]["text"] == ref["text"]
    assert text["choices"][0]["token_ids"] == ref["token_ids"]
    tokens = [c["token"] for c in text["choices"][0]["logprobs"]["content"]]
    assert tokens == ref["logprobs"]["tokens"]  # decoded, as chat shows them


def test_a_stream_carries_the_same_tokens_then_usage_then_done(cluster: Cluster) -> None:
    sp = {"max_tokens": 10, "temperature": 0.9, "n": 2, "seed": 7}
    whole = _post(cluster, "/inference/v1/generate",
                  {"token_ids": PROMPT, "sampling_params": sp}).json()  # fmt: skip
    events = _events(cluster, {
        "token_ids": PROMPT, "sampling_params": sp, "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 20
    for i in range(2):  # each choice: the seeded tokens of the whole response
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert [t for c in mine for t in c["token_ids"]] == whole["choices"][i]["token_ids"]
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    counted = [c["usage"]["completion_tokens"] for c in chunks[:-1]
               if c["choices"][0]["index"] == 0]  # fmt: skip
    assert counted == sorted(counted) and counted[-1] == 10


def test_a_rendered_request_sent_to_generate_gives_its_own_answer(cluster: Cluster) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    chat = {"model": cluster.model_name, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Yes or no, as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}}  # fmt: skip
    rendered = _post(cluster, "/v1/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    tok = _post(cluster, "/tokenize", {"model": cluster.model_name,
                                        "messages": chat["messages"]}).json()  # fmt: skip
    assert body["token_ids"] == tok["tokens"]
    assert body["sampling_params"]["structured_outputs"]["json"] == schema
    assert body["sampling_params"]["max_tokens"] == 24
    answer = _post(cluster, "/v1/chat/completions", chat).json()["choices"][0]
    got = _post(cluster, "/inference/v1/generate", {**body, "output_mode": "text"}).json()
    assert got["choices"][0]["text"] == answer["message"]["content"]
    json.loads(got["choices"][0]["text"])  # the grammar held

    comp = {"model": cluster.model_name, "prompt": ["Once upon", "a time"], "max_tokens": 6,
            "temperature": 0, "stop": ["\n"], "presence_penalty": 0.5}  # fmt: skip
    bodies = _post(cluster, "/v1/completions/render", comp).json()
    assert len(bodies) == 2 and bodies[0]["sampling_params"]["stop"] == ["\n"]
    answers = _post(cluster, "/v1/completions", comp).json()["choices"]
    for b, a in zip(bodies, answers, strict=True):
        got = _post(cluster, "/inference/v1/generate", {**b, "output_mode": "text"}).json()
        assert got["choices"][0]["text"] == a["text"]
        assert got["choices"][0]["finish_reason"] == a["finish_reason"]


def test_a_rendered_message_sent_to_generate_gives_the_messages_answer(
    cluster: Cluster,
) -> None:
    msg = {"model": cluster.model_name, "max_tokens": 9, "temperature": 0, "system": "Be brief.",
           "messages": [{"role": "user", "content": "Say hello."}]}  # fmt: skip
    body = _post(cluster, "/v1/messages/render", msg)
    assert body.status_code == 200, body.text
    answer = _post(cluster, "/v1/messages", msg).json()
    got = _post(cluster, "/inference/v1/generate", {**body.json(), "output_mode": "text"})
    assert got.json()["choices"][0]["text"] == answer["content"][0]["text"]
    # Anthropic's input_tokens leave out what the prefix cache served
    used = answer["usage"]
    assert got.json()["usage"]["prompt_tokens"] == (
        used["input_tokens"] + (used.get("cache_read_input_tokens") or 0)
    )
    bad = _post(cluster, "/v1/messages/render", {**msg, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["type"] == "error"  # Anthropic's shape


def test_abort_ends_a_running_request_with_the_tokens_it_had(cluster: Cluster) -> None:
    sp = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}
    body = {"request_id": "abort-me", "token_ids": PROMPT, "stream": True, "sampling_params": sp}
    out: list[list[dict | str]] = []
    t = threading.Thread(target=lambda: out.append(_events(cluster, body)))
    t.start()
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:  # until it has started and ended
        time.sleep(0.3)
        r = _post(cluster, "/abort_requests", {"request_ids": ["generate-tokens-abort-me"]})
        assert r.status_code == 200
    t.join(5)
    assert out, "the aborted stream did not end"
    chunks = [e for e in out[0] if isinstance(e, dict)]
    assert out[0][-1] == "[DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    got = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
    assert 0 < got < 1900
    # unknown ids are ignored, as vLLM ignores them
    assert (
        _post(cluster, "/inference/v1/abort_requests", {"request_ids": ["nope"]}).status_code == 200
    )


def test_the_x_request_id_header_names_a_generate_request(cluster: Cluster) -> None:
    body = {"request_id": "from-body", "token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    r = httpx.post(f"{cluster.url}/inference/v1/generate", json=body,
                   headers={"X-Request-Id": "from-header"}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["request_id"] == "generate-tokens-from-header"
    assert _post(cluster, "/inference/v1/generate", body).json()["request_id"] == (
        "generate-tokens-from-body"
    )


def test_abort_sent_to_another_api_replica_ends_the_request(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Behind a load balancer the abort may reach another API process than the one serving
    the request: every API process hears it (ABORTS_CHANNEL)."""
    other, other_url = start_api(
        "api-abort-replica", base_env(cluster.redis_url, cluster.model_dir), tmp_path
    )
    try:
        sp = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}
        body = {"request_id": "abort-elsewhere", "token_ids": PROMPT, "stream": True,
                "sampling_params": sp}  # fmt: skip
        out: list[list[dict | str]] = []
        t = threading.Thread(target=lambda: out.append(_events(cluster, body)))
        t.start()
        deadline = time.monotonic() + 60
        while t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.3)
            r = httpx.post(f"{other_url}/abort_requests",
                           json={"request_ids": ["abort-elsewhere"]}, timeout=30)  # fmt: skip
            assert r.status_code == 200
        t.join(5)
        assert out, "the aborted stream did not end"
        chunks = [e for e in out[0] if isinstance(e, dict)]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert 0 < sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 1900
    finally:
        other.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": PROMPT, "sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
    ({"token_ids": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": PROMPT, "sampling_params": {"watermarking": True}},
     "sampling_params.watermarking"),
    ({"token_ids": [1, 10**9]}, "token_ids"),
    ({"token_ids": PROMPT, "features": {"mm_hashes": {}}}, "features"),
    ({"token_ids": PROMPT, "kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 10**6}},
     "sampling_params.max_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {"stop_token_ids": [10**9]}},
     "sampling_params.stop_token_ids"),
])  # fmt: skip
def test_bad_bodies_get_a_400_naming_the_field(cluster: Cluster, body: dict, param: str) -> None:
    r = _post(cluster, "/inference/v1/generate", body)
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_empty_prompts_and_unknown_models_are_refused(cluster: Cluster) -> None:
    r = _post(cluster, "/inference/v1/generate", {"token_ids": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    r = _post(cluster, "/inference/v1/generate", {"token_ids": PROMPT, "model": "nope"})
    assert r.status_code == 404
