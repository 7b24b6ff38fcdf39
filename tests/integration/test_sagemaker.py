"""The serving-platform endpoints (api/routes_sagemaker.py) on the session cluster, through
real HTTP: ``/invocations`` answers each body shape as the endpoint that takes it would,
``/ping`` as ``/health``, ``/version``."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "Name a queue."}]


def _post(cluster: Cluster, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=60)


def test_invocations_answer_as_the_endpoint_of_the_body_s_shape(cluster: Cluster) -> None:
    m = cluster.model_name
    shapes = [
        ("/v1/chat/completions", {"model": m, "messages": MSGS, "max_tokens": 5,
                                  "temperature": 0}),
        ("/v1/completions", {"model": m, "prompt": "Name a queue", "max_tokens": 5,
                             "temperature": 0}),
        ("/v1/embeddings", {"model": m, "input": ["one", "two"]}),
        ("/rerank", {"model": m, "query": "queue", "documents": ["a queue", "a cat"]}),
        ("/score", {"model": m, "text_1": "queue", "text_2": ["a queue", "a cat"]}),
        ("/score", {"model": m, "queries": "queue", "documents": ["a queue"]}),
    ]  # fmt: skip
    for path, body in shapes:
        want, got = _post(cluster, path, body), _post(cluster, "/invocations", body)
        assert (got.status_code, want.status_code) == (200, 200), (path, got.text)
        w, g = want.json(), got.json()
        for key in ("id", "created"):  # each answer is its own request
            w.pop(key, None), g.pop(key, None)
        for body_ in (w, g):  # the second run may find the first's prefix cached
            (body_.get("usage") or {}).pop("prompt_tokens_details", None)
        if path == "/v1/embeddings":
            assert g["data"][1]["embedding"] == pytest.approx(w["data"][1]["embedding"], abs=1e-5)
            g.pop("data"), w.pop("data")
        if path in ("/rerank", "/score"):
            (gi, gs), (wi, ws) = _scores(g), _scores(w)
            assert gi == wi and gs == pytest.approx(ws, abs=1e-5)
            g.pop("results", None), w.pop("results", None), g.pop("data", None), w.pop("data", None)
        assert g == w, path


def _scores(body: dict) -> tuple[list[int], list[float]]:
    """A rerank's or a score's (indices in order, scores)."""
    rows = body.get("results") or body.get("data") or []
    return [r["index"] for r in rows], [r.get("relevance_score", r.get("score")) for r in rows]


def test_a_streamed_invocation_streams(cluster: Cluster) -> None:
    body = {"model": cluster.model_name, "messages": MSGS, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/invocations", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(("body", "param"), [
    ({"nothing": 1}, None),
    ([1, 2], None),
    ({"messages": [], "model": "x"}, "messages"),
    ({"prompt": "x", "model": "m", "max_tokens": -1}, "max_tokens"),
])  # fmt: skip
def test_a_body_of_no_known_shape_or_a_bad_field_is_a_400(
    cluster: Cluster, body: object, param: str | None
) -> None:
    r = _post(cluster, "/invocations", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    raw = httpx.post(f"{cluster.url}/invocations", content=b"{not json", timeout=10)
    assert raw.status_code == 400


def test_ping_is_health_and_version(cluster: Cluster) -> None:
    health = httpx.get(f"{cluster.url}/health").json()
    for r in (httpx.get(f"{cluster.url}/ping"), httpx.post(f"{cluster.url}/ping")):
        assert r.status_code == 200 and r.json() == health
    from importlib.metadata import version

    assert httpx.get(f"{cluster.url}/version").json() == {"version": version("conveyor")}
