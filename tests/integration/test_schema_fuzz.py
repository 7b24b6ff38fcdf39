"""Schema fuzzing of the API's own ``/openapi.json`` with schemathesis (real redis-server,
a real mock-engine worker, a real API process, real HTTP): for every operation, bodies that
fit the schema and bodies that break it. No answer is a 5xx; every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}``; a stream that answers 200 ends with
``[DONE]`` or an error event of the same shape (a Responses stream: on its last state,
``response.completed`` or ``response.failed`` after an ``error`` event). Anthropic's
Messages API (``/v1/messages``) answers in its own shape: errors
``{"type": "error", "error": {"type", "message", "param"?}}``, streams ending on
``message_stop`` or such an error event.

Bounded: ``EXAMPLES`` cases per operation and mode (about two minutes on two cores for the
55 operations there are, both modes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from api.errors import anthropic_path
from tasks.batches import runners_key
from tests.integration.conftest import (
    BIN,
    base_env,
    spawn,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.integration

EXAMPLES = 50
ERROR_KEYS = {"message", "type", "param", "code"}
RESPONSE_ENDS = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture(scope="module")
def api_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("fuzz")
    rproc, rurl = start_redis(d)
    env = base_env(rurl, tiny_model_dir, CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP="200",
                   CONVEYOR_MEDIA_FETCH_TIMEOUT_S="1", CONVEYOR_FIRST_FRAME_TIMEOUT_S="20",
                   CONVEYOR_MAX_MODEL_LEN="512", CONVEYOR_FILES_DIR=str(d / "files"))  # fmt: skip
    procs = [rproc]
    try:
        with stop_on_error(*procs):
            procs.append(start_worker("fuzz-w", "generate", "fuzz-w", env, d))
            api, url = start_api("fuzz-api", env, d)
            procs.append(api)
            # a batch runner, so that a valid batch is taken (not a 503 for want of one)
            env["CONVEYOR_BATCH_API_URL"] = url
            procs.append(spawn("fuzz-batch-runner", [str(BIN / "conveyor"), "batch-runner"],
                               env, d))  # fmt: skip
            wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 60,
                     "a live worker", procs)  # fmt: skip
            r = redis.Redis.from_url(rurl)
            wait_for(lambda: r.zcount(runners_key(), int(time.time() * 1000), "+inf"), 60,
                     "a live batch runner", procs)  # fmt: skip
        yield url
    finally:
        for p in reversed(procs):
            p.stop()


def _check_error(body: object, where: str, anthropic: bool = False) -> None:
    if anthropic:
        assert isinstance(body, dict) and set(body) == {"type", "error"}, where
        assert body["type"] == "error" and isinstance(body["error"], dict), where
        err = body["error"]
        assert set(err) - {"param"} == {"type", "message"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str) and err["type"], where
        return
    assert isinstance(body, dict) and set(body) == {"error"}, where
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, where
    assert isinstance(err["message"], str) and err["message"], where
    assert isinstance(err["type"], str) and err["type"], where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] is None or isinstance(err["code"], str), where


def _check(status: int, headers: httpx.Headers | dict, text: str, where: str,
           path: str = "") -> None:  # fmt: skip
    assert status < 500, f"{status} for {where}: {text[:500]}"
    ctype = headers.get("content-type", "")
    anthropic = anthropic_path(path)
    if status >= 400:
        assert ctype.startswith("application/json"), where
        _check_error(json.loads(text), f"{status} for {where}: {text[:500]}", anthropic)
    elif ctype.startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events, where
        last = events[-1]
        if anthropic:  # Anthropic's stream: message_stop, or an error event
            body = json.loads(last)
            if body.get("type") != "message_stop":
                _check_error(body, f"stream of {where}: {last[:500]}", anthropic)
            return
        if last == "[DONE]":  # chat and completions end here, after an error event if
            # one failed (as vLLM's)
            if len(events) > 1 and '"error"' in events[-2] and events[-2].startswith('{"error"'):
                _check_error(json.loads(events[-2]), f"stream of {where}: {events[-2][:500]}")
            return
        body = json.loads(last)
        if isinstance(body, dict) and "type" in body:  # the Responses API's events: no
            # [DONE]; it ends on the response's last state, after an error event if it failed
            assert body["type"] in RESPONSE_ENDS, f"stream of {where}: {last[:500]}"
            assert isinstance(body.get("response"), dict), where
            if body["type"] == "response.failed":
                err = json.loads(events[-2])
                assert err.get("type") == "error" and err.get("message"), where
            return
        _check_error(body, f"stream of {where}: {last[:500]}")  # ended with an error event


def _fuzzer(client: httpx.Client, url: str, model: str, op, mode: GenerationMode,  # type: ignore[no-untyped-def]
            seen: dict[str, set[int]]):  # fmt: skip
    """A hypothesis test of ``op``: its cases sent through ``client``, each answer checked."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode), served=st.booleans())
    def fuzz(case, served: bool) -> None:  # type: ignore[no-untyped-def]
        if served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model  # past the model check: to the router and a worker
        kw = case.as_transport_kwargs(base_url=url)
        r = client.request(kw["method"], kw["url"], headers=kw.get("headers"),
                           params=kw.get("params"), json=kw.get("json"),
                           content=kw.get("data"))  # fmt: skip
        where = f"{op.method.upper()} {op.path} {str(kw.get('json', kw.get('data')))[:300]}"
        _check(r.status_code, r.headers, r.text, where, op.path)
        seen.setdefault(op.path, set()).add(r.status_code)

    return fuzz


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_every_error_in_openai_shape(
    api_url: str, tiny_model_dir: Path, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings",
            "/tokenize", "/detokenize"} <= paths, paths  # fmt: skip
    seen: dict[str, set[int]] = {}
    with httpx.Client(base_url=api_url, timeout=60, trust_env=False) as client:
        for op in ops:
            if op.method.upper() == "GET" and op.path in ("/metrics", "/docs", "/redoc"):
                continue  # not JSON endpoints

            try:
                _fuzzer(client, api_url, tiny_model_dir.name, op, mode, seen)()
            except Unsatisfiable:  # nothing to break in an operation without inputs: no
                # body, no query, only path parameters (any string is one)
                assert mode == GenerationMode.NEGATIVE, op.path
                assert not len(op.body) and not len(op.query), op.path
    print(f"\n{mode.value}: statuses per path {seen}")
    work = ("/v1/completions", "/v1/chat/completions")
    assert all(400 in seen[p] for p in work), seen  # violations refused, as OpenAI does
    if mode == GenerationMode.POSITIVE:  # and some valid requests ran on the worker
        assert any(200 in seen[p] for p in work), seen
