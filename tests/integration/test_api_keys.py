"""API keys (real API process, real worker, the official openai client): without a key or
with a wrong one the API answers 401 in OpenAI's shape (Anthropic's on its Messages API,
whose clients send the key as ``x-api-key``) and runs nothing; with one of the
configured keys it serves; /health and /metrics stay open unless configured otherwise."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.integration.conftest import (
    BIN,
    base_env,
    free_port,
    spawn,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

REFUSED = [
    ({}, "didn't provide"),
    ({"Authorization": "Bearer sk-nope"}, "Incorrect API key"),
    ({"Authorization": "sk-first"}, "didn't provide"),  # not the Bearer scheme
]


@pytest.mark.parametrize("protect_ops", [False, True])
def test_requests_need_a_configured_key(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, protect_ops: bool
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nsk-first\n\nsk-second\n")
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="20", CONVEYOR_API_KEYS=f"@{keys}",
                   CONVEYOR_API_KEYS_PROTECT_OPS=str(protect_ops).lower())  # fmt: skip
    worker = start_worker("keys-worker", "generate", "keys-w", env, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(worker):
        api = spawn("keys-api", [str(BIN / "conveyor"), "api", "--port", str(port)], env,
                    tmp_path)  # fmt: skip
    try:
        auth = {"Authorization": "Bearer sk-second"}
        wait_for(lambda: httpx.get(f"{url}/health", headers=auth).status_code == 200, 60,
                 "a live worker", [worker, api])  # fmt: skip
        body = {"model": tiny_model_dir.name, "prompt": "x", "max_tokens": 2}
        for headers, why in REFUSED:
            r = httpx.post(f"{url}/v1/completions", headers=headers, json=body)
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert why in err["message"], err
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-first", max_retries=0)
        out = client.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=3)
        assert out.usage.completion_tokens == 3
        ops = [httpx.get(f"{url}/health").status_code, httpx.get(f"{url}/metrics").status_code,
               httpx.get(f"{url}/ping").status_code]  # fmt: skip
        assert ops == ([401, 401, 401] if protect_ops else [200, 200, 200])
        assert httpx.get(f"{url}/version").status_code == 200  # open, as in vLLM
        # the model's endpoints outside /v1/ are keyed too (vLLM leaves them open); the
        # refused ones run nothing
        for path, body in (("/invocations", {"prompt": "x", "max_tokens": 2}),
                           ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]}),
                           ("/v2/rerank", {"query": "a", "documents": ["b"]}),
                           ("/inference/v1/generate", {"token_ids": [1]}),
                           ("/abort_requests", {"request_ids": ["x"]}),
                           ("/v1/completions/render", {"prompt": "x"})):  # fmt: skip
            assert httpx.post(f"{url}{path}", json=body).status_code == 401, path
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
        # vLLM's tokenizer endpoints are keyed like /v1/ (vLLM leaves them open)
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(f"{url}{path}", json=body).status_code == 401
            assert httpx.post(f"{url}{path}", json=body, headers=auth).status_code == 200
        # Anthropic's clients send the key as x-api-key; a refusal on the Messages API is
        # in Anthropic's shape
        a_body = {"model": tiny_model_dir.name, "max_tokens": 3,
                  "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
        r = httpx.post(f"{url}/v1/messages", json=a_body, headers={"x-api-key": "sk-nope"})
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="sk-wrong",
                                max_retries=0).messages.create(**a_body)  # fmt: skip
        msg = anthropic.Anthropic(base_url=url, api_key="sk-first",
                                  max_retries=0).messages.create(**a_body)  # fmt: skip
        assert msg.usage.output_tokens == 3
        # nothing ran for the refused requests: the worker served exactly two (its line for
        # a request comes once the engine has told it, which can be after the client's
        # last frame)
        wait_for(lambda: worker.log.read_text().count("output tokens") >= 2, 10,
                 "the worker's line for the second request", [worker])  # fmt: skip
        assert worker.log.read_text().count("output tokens") == 2
    finally:
        api.stop()
        worker.stop()
