"""Sequence classifiers on the cluster (real API, Redis and a worker running the reference
engine): ``/classify``, ``/pooling`` and a cross-encoder's ``/score`` and ``/rerank``
give what Hugging Face's ``LlamaForSequenceClassification`` computes on the same
checkpoint (its logits through the model's activation), and every endpoint the model does
not serve is a clear 400 (the official client for the OpenAI ones)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.integration.conftest import Cluster, RedisDbs, base_env, one_worker
from workers.model_init import PRESETS, init_model

pytestmark = pytest.mark.integration

TEXTS = ["I loved every minute of it.", "The service was slow and the food cold.", "ok"]
QUERY = "What do cats eat?"
DOCS = ["Cats eat fish and meat.", "The stock market fell today.", "Kittens drink milk."]


def _deploy(preset: str, redis_dbs: RedisDbs, tmp: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = init_model(tmp.mktemp("models") / f"tiny-{preset}", PRESETS[preset])
    env = base_env(redis_dbs.take(f"{__name__}.{preset}"), model)
    with one_worker(preset, preset, env, model, tmp.mktemp(preset)) as c:
        yield c


@pytest.fixture(scope="module")
def classifier(redis_dbs: RedisDbs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _deploy("classifier", redis_dbs, tmp_path_factory)


@pytest.fixture(scope="module")
def reranker(redis_dbs: RedisDbs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _deploy("reranker", redis_dbs, tmp_path_factory)


def _hf_logits(model_dir: Path, ids: list[list[int]]) -> list[np.ndarray]:
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([x])).logits[0].double().numpy() for x in ids]


def _post(c: Cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{c.url}{path}", json={"model": c.model_name, **body}, timeout=60)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_classify_gives_hugging_faces_probabilities(classifier: Cluster) -> None:
    tok = AutoTokenizer.from_pretrained(classifier.model_dir)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    want = [_softmax(x) for x in _hf_logits(classifier.model_dir, ids)]
    labels = ["negative", "positive"]
    for path in ("/classify", "/v1/classify"):
        r = _post(classifier, path, {"input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, p in zip(body["data"], want, strict=True):
            assert d["num_classes"] == 2
            assert d["probs"] == pytest.approx(p.tolist(), abs=1e-5)
            assert d["label"] == labels[int(np.argmax(p))]
        n = sum(len(x) for x in ids)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == n
    # token ids, one input; raw logits with use_activation false; model left out
    (raw,) = _hf_logits(classifier.model_dir, [ids[1]])
    r = httpx.post(f"{classifier.url}/classify",
                   json={"input": ids[1], "use_activation": False}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["probs"] == pytest.approx(raw.tolist(), abs=1e-5)


def test_classify_takes_chat_messages_and_pooling_classifies(classifier: Cluster) -> None:
    msgs = [{"role": "user", "content": TEXTS[0]}]
    tok = AutoTokenizer.from_pretrained(classifier.model_dir)
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in newer HF
    (want,) = [_softmax(x) for x in _hf_logits(classifier.model_dir, [list(ids)])]
    r = _post(classifier, "/classify", {"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["probs"] == pytest.approx(want.tolist(), abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # /pooling: the model's own task (classify) without one, its probabilities as data
    direct = _post(classifier, "/classify", {"input": TEXTS}).json()["data"]
    for body in ({"input": TEXTS}, {"input": TEXTS, "task": "classify"}):
        r = _post(classifier, "/pooling", body)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["data"] for d in r.json()["data"]],
                                   [d["probs"] for d in direct], atol=1e-6)  # fmt: skip
    # /invocations routes an `input` body to the classifier
    r = _post(classifier, "/invocations", {"input": TEXTS[:1]})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["probs"] == pytest.approx(direct[0]["probs"], abs=1e-6)


def test_what_a_classifier_does_not_serve_is_a_clear_400(classifier: Cluster) -> None:
    client = classifier.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=classifier.model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert e.value.body["param"] == "model" and "classifier" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=classifier.model_name, prompt="hi", max_tokens=4)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=classifier.model_name, input="hi")
    assert e.value.body["param"] == "model" and "embeddings" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=classifier.model_name, input="hi")
    assert e.value.body["param"] == "model"
    cases = [
        ("/pooling", {"input": "hi", "task": "embed"}, "task"),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS}, "model"),  # two labels: no score
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": "word " * 5000}, "input"),
    ]
    for path, body, param in cases:
        r = _post(classifier, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = _post(classifier, "/classify", {"input": "hi", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # the worker is still serving after all that
    assert _post(classifier, "/classify", {"input": "hi"}).status_code == 200


def test_classify_on_a_generative_model_is_a_400(cluster: Cluster) -> None:
    r = _post(cluster, "/classify", {"input": "hi"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "classification head" in err["message"]


def _pair_scores(c: Cluster, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    tok = AutoTokenizer.from_pretrained(c.model_dir)
    ids = [tok(q, d)["input_ids"] for q, d in pairs]
    logits = _hf_logits(c.model_dir, ids)
    return [float(1 / (1 + np.exp(-x[0]))) for x in logits], sum(len(x) for x in ids)


def test_cross_encoder_scores_are_hugging_faces(reranker: Cluster) -> None:
    want, tokens = _pair_scores(reranker, [(QUERY, d) for d in DOCS])
    assert len({round(w, 6) for w in want}) == len(DOCS)  # distinct: the order means something
    for a, b in (("text_1", "text_2"), ("queries", "documents")):
        r = _post(reranker, "/v1/score", {a: QUERY, b: DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        assert body["usage"]["prompt_tokens"] == tokens  # each pair once
    # N:N, and the raw logit with use_activation false
    nn, _ = _pair_scores(reranker, [(QUERY, DOCS[0]), (DOCS[1], DOCS[2])])
    r = _post(reranker, "/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[0], DOCS[2]]})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(nn, abs=1e-5)
    raw = _post(reranker, "/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False})
    assert raw.json()["data"][0]["score"] == pytest.approx(np.log(want[0] / (1 - want[0])),
                                                           abs=1e-4)  # fmt: skip
    # rerank: most relevant first, cut by top_n
    order = sorted(range(len(DOCS)), key=lambda i: want[i], reverse=True)
    r = _post(reranker, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    assert [x["index"] for x in got] == order[:2]
    assert [x["relevance_score"] for x in got] == pytest.approx([want[i] for i in order[:2]],
                                                                abs=1e-5)  # fmt: skip


def test_cross_encoder_cuts_query_and_document_before_pairing(reranker: Cluster) -> None:
    tok = AutoTokenizer.from_pretrained(reranker.model_dir)
    doc = "Cats eat fish and meat, and sometimes they drink a little milk too."
    cut = tok.decode(tok(doc, add_special_tokens=False)["input_ids"][:4])
    want, tokens = _pair_scores(reranker, [(QUERY, cut)])
    r = _post(reranker, "/v1/score", {"text_1": QUERY, "text_2": doc, "max_tokens_per_doc": 4})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == tokens
