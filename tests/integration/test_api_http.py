"""The API's HTTP front, as ``vllm serve``'s (real API and mock-engine worker processes,
a throwaway CA made with openssl, the official openai client): CORS for browsers
(preflights answered before the API-key check, the allowed origins only, vLLM's default
of any origin), HTTPS with client certificates required, a reverse proxy's root path,
and the batch runner calling its API over that HTTPS."""

from __future__ import annotations

import io
import json
import shutil
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tasks.batches import runners_key
from tests.integration.conftest import (
    BIN,
    Cluster,
    Proc,
    base_env,
    free_port,
    spawn,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.tls_util import make_ca, make_server_cert

pytestmark = pytest.mark.integration

UI, OTHER = "https://ui.example", "https://elsewhere.example"
KEY = "sk-cors-test"


def test_vllms_default_lets_any_origin_read_the_answers(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", headers={"Origin": OTHER}, json={
        "model": cluster.model_name, "prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    plain = httpx.get(f"{cluster.url}/v1/models")  # no Origin: no CORS headers
    assert "access-control-allow-origin" not in plain.headers


@pytest.fixture(scope="module")
def cors_api(redis_dbs, tiny_model_dir: Path,  # type: ignore[no-untyped-def]
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # fmt: skip
    d = tmp_path_factory.mktemp("cors")
    env = base_env(redis_dbs.take(f"{__name__}.cors"), tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_API_KEYS=KEY, CONVEYOR_ALLOWED_ORIGINS=json.dumps([UI]),
                   CONVEYOR_ALLOWED_HEADERS="authorization,content-type")  # fmt: skip
    worker = start_worker("cors-worker", "generate", "cors-w", env, d)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(worker):
        api = spawn("cors-api", [str(BIN / "conveyor"), "api", "--port", str(port)], env, d)
    with stop_on_error(worker, api):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "cors-api up",
                 [worker, api])  # fmt: skip
    yield url
    for p in (api, worker):
        p.stop()


def test_cors_preflights_pass_the_key_check_and_only_allowed_origins_get_answers(
    cors_api: str,
) -> None:
    url = f"{cors_api}/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    pre = httpx.options(url, headers={"Origin": UI, **ask})  # no key: browsers send none
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == UI
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert httpx.options(url, headers={"Origin": OTHER, **ask}).status_code == 400
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = httpx.post(url, json=body, headers={"Origin": UI, **auth})
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
    assert ok.headers["access-control-allow-origin"] == UI
    refused = httpx.post(url, json=body, headers={"Origin": UI})  # the 401 is readable too
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
    other = httpx.post(url, json=body, headers={"Origin": OTHER, **auth})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def _runners(redis_url: str) -> int:
    return int(redis.Redis.from_url(redis_url).zcount(runners_key(), int(time.time() * 1000),
                                                      "+inf"))  # fmt: skip


def test_https_with_client_certificates_a_root_path_and_the_batch_runner(
    redis_dbs, tiny_model_dir: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:  # fmt: skip
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's CA")
    ca = make_ca(tmp_path, "api-ca")
    cert, key = make_server_cert(tmp_path, ca)
    client_cert = make_server_cert(tmp_path, ca, "client")
    redis_url = redis_dbs.take(f"{__name__}.https")
    port = free_port()
    env = base_env(redis_url, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_SSL_CERTFILE=str(cert), CONVEYOR_SSL_KEYFILE=str(key),
                   CONVEYOR_SSL_CA_CERTS=str(ca[0]), CONVEYOR_SSL_CERT_REQS="2",
                   CONVEYOR_ROOT_PATH="/llm", CONVEYOR_PORT=str(port),
                   CONVEYOR_FILES_DIR=str(tmp_path / "files"))  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=str(ca[0]))
    shown = ssl.create_default_context(cafile=str(ca[0]))
    shown.load_cert_chain(str(client_cert[0]), str(client_cert[1]))
    https = httpx.Client(verify=shown)
    procs: list[Proc] = [start_worker("https-worker", "generate", "https-w", env, tmp_path)]
    try:
        procs.append(spawn("https-api", [str(BIN / "conveyor"), "api"], env, tmp_path))
        procs.append(spawn("https-runner", [str(BIN / "conveyor"), "batch-runner"], env,
                           tmp_path))  # fmt: skip

        def up() -> bool:
            try:
                return https.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the API over HTTPS with a live worker", procs)
        wait_for(lambda: _runners(redis_url), 60, "a live batch runner", procs)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=https)
        got = c.chat.completions.create(model=tiny_model_dir.name, max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        assert got.usage is not None and got.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(f"{url}/health", verify=trusted, timeout=5)
        # the proxy's prefix: in the OpenAPI document's servers, and the docs load it there
        spec = https.get(f"{url}/openapi.json").json()
        assert spec["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in https.get(f"{url}/docs").text

        # the batch runner finds the API by its port, over the same HTTPS (the API's own
        # certificate shown as its client certificate)
        lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": tiny_model_dir.name, "prompt": f"p{i}",
                                      "max_tokens": 3}}) for i in range(3)]  # fmt: skip
        f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                           purpose="batch")  # fmt: skip
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 60
        while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, b.request_counts
            time.sleep(0.2)
        assert b.status == "completed" and b.request_counts is not None
        errors = c.files.content(b.error_file_id).text if b.error_file_id else ""
        assert b.request_counts.completed == 3, errors[:1000]
    finally:
        https.close()
        for p in reversed(procs):
            p.stop()


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ greeting }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def front(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API beside the session cluster's, on its workers, with vLLM's front-end options:
    its own chat template (a file), default template variables, usage on every stream, a
    second name for the model."""
    d = tmp_path_factory.mktemp("front")
    (d / "template.jinja").write_text(TEMPLATE)
    env = base_env(cluster.redis_url, cluster.model_dir,
                   CONVEYOR_CHAT_TEMPLATE=str(d / "template.jinja"),
                   CONVEYOR_DEFAULT_CHAT_TEMPLATE_KWARGS='{"greeting": "HELLO"}',
                   CONVEYOR_FORCE_INCLUDE_USAGE="true",
                   CONVEYOR_SERVED_MODEL_NAME=f"{cluster.model_name}, front-alias")  # fmt: skip
    port = free_port()
    api = spawn("front-api", [str(BIN / "conveyor"), "api", "--port", str(port)], env, d)
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(api):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "front-api", [api])
    yield url
    api.stop()


def _rendered(url: str, model: str, **kw: object) -> str:
    ids = httpx.post(f"{url}/tokenize", json={
        "model": model, "messages": [{"role": "user", "content": "hi there"}], **kw,
    }).json()["tokens"]  # fmt: skip
    return httpx.post(f"{url}/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]


def test_the_deployments_chat_template_and_its_default_variables(
    cluster: Cluster, front: str
) -> None:
    model = cluster.model_name
    assert "HELLO: hi there" in _rendered(front, model).replace("  ", " ")
    assert "BYE: hi there" in _rendered(front, model, chat_template_kwargs={"greeting": "BYE"})
    assert "HELLO" not in _rendered(cluster.url, model)  # the model's own template elsewhere
    c = openai.OpenAI(base_url=f"{front}/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model=model, max_tokens=3,
                                  messages=[{"role": "user", "content": "hi there"}])  # fmt: skip
    msgs = [{"role": "user", "content": "hi there"}]
    want = len(httpx.post(f"{front}/tokenize", json={"model": model, "messages": msgs}).json()[
        "tokens"])  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens == want


def test_forced_usage_and_the_servers_load(cluster: Cluster, front: str) -> None:
    model = cluster.model_name
    assert httpx.get(f"{front}/load").json() == {"server_load": 0}
    body = {"model": model, "prompt": "a b c", "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{front}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert httpx.get(f"{front}/load").json() == {"server_load": 1}  # the stream open
        chunks = [json.loads(first[6:])] + [json.loads(ln[6:]) for ln in lines
                                              if ln.startswith("data: {")]  # fmt: skip
    # no stream_options asked: usage on every chunk anyway, and a last usage-only chunk
    assert all(ch.get("usage") for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 200
    wait_for(lambda: httpx.get(f"{front}/load").json() == {"server_load": 0}, 5, "load 0")


def test_the_model_answers_to_each_of_its_served_names(cluster: Cluster, front: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{front}/v1/models").json()["data"]]
    assert ids[:2] == [cluster.model_name, "front-alias"]
    assert httpx.get(f"{front}/v1/models/front-alias").json()["id"] == "front-alias"
    c = openai.OpenAI(base_url=f"{front}/v1", api_key="x", max_retries=0)
    prompt = "The same words under either name, long enough for whole blocks. " * 3
    first = c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=2)
    second = c.completions.create(model="front-alias", prompt=prompt, max_tokens=2)
    assert second.model == "front-alias"  # named as asked
    # one model, one KV namespace: the second name finds the first one's blocks cached
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-name", prompt="x", max_tokens=2)
