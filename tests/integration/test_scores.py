"""vLLM's /score and /rerank on the cluster (real API, Redis and workers): each score is the
cosine similarity of the two texts' embeddings as ``/v1/embeddings`` gives them (the
official client), pairs 1:N and N:N under every field name vLLM takes, rerank ordered and
cut by ``top_n`` on all three paths, and clear 4xx errors."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

QUERY = "What do cats eat?"
DOCS = ["Cats eat fish and meat.", "The stock market fell today.", "Kittens drink milk.",
        "Rain is expected tomorrow."]  # fmt: skip


def _embeddings(cluster: Cluster, texts: list[str]) -> tuple[list[np.ndarray], int]:
    out = cluster.client().embeddings.create(model=cluster.model_name, input=texts)
    return [np.asarray(d.embedding, dtype=np.float64) for d in out.data], out.usage.prompt_tokens


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _post(cluster: Cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json={"model": cluster.model_name, **body},
                      timeout=60)  # fmt: skip


def test_scores_are_the_cosine_of_the_embeddings(cluster: Cluster) -> None:
    vecs, tokens = _embeddings(cluster, [QUERY, *DOCS])
    want = [_cos(vecs[0], v) for v in vecs[1:]]
    assert len({round(w, 6) for w in want}) == len(DOCS)  # distinct: the order means something
    for path in ("/score", "/v1/score"):
        for a, b in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                     ("data_1", "data_2")):  # fmt: skip
            r = _post(cluster, path, {a: QUERY, b: DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == cluster.model_name
            assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
            assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
            assert body["usage"]["prompt_tokens"] == tokens  # every text counted once
    # N:N pairs each query with its own document
    r = _post(cluster, "/v1/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[0], DOCS[2]]})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [want[0], _cos(vecs[2], vecs[3])], abs=1e-5)  # fmt: skip


def test_rerank_orders_and_cuts_the_documents(cluster: Cluster) -> None:
    vecs, tokens = _embeddings(cluster, [QUERY, *DOCS])
    want = sorted(((_cos(vecs[0], v), i) for i, v in enumerate(vecs[1:])), reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(cluster, path, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert [x["index"] for x in results] == [i for _, i in want]
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [s for s, _ in want], abs=1e-5)  # fmt: skip
        assert [x["document"]["text"] for x in results] == [DOCS[i] for _, i in want]
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    top = _post(cluster, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [x["index"] for x in top["results"]] == [i for _, i in want[:2]]


def test_bad_scoring_requests_are_clear_4xx(cluster: Cluster) -> None:
    cases = [
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, 400, "text_2"),
        ("/v1/score", {"text_1": QUERY}, 400, "queries"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, 400, "text_2"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, 400, None),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "other"}, 404, "model"),
        ("/v1/score", {"text_1": "word " * 5000, "text_2": "x"}, 400, "input"),
    ]
    for path, body, status, param in cases:
        r = _post(cluster, path, body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], err
        if param is not None:
            assert err["param"] == param, (body, err)
    # truncated to fit, the same long text is scored
    r = _post(cluster, "/v1/score", {"text_1": "word " * 5000, "text_2": "x",
                                     "truncate_prompt_tokens": -1})  # fmt: skip
    assert r.status_code == 200, r.text
    assert -1.0 <= r.json()["data"][0]["score"] <= 1.0
