"""/v1/embeddings through the whole pipeline (the official openai client -> HTTP -> Celery
``embed`` task -> a reference worker's engine process -> the request's token stream ->
JSON), checked against Hugging Face's hidden states on the same checkpoint, pooled and
normalised by this test's own code; vLLM's /tokenize and /detokenize against the
tokenizer; embeddings in the P/D mode (on the decode pool); and a mock-engine worker
refusing embeddings with a 400."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from tests.integration.conftest import (
    Cluster,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello, world!",
    "Once upon a time there was a small model",
    "1 2 3",
    "The cache holds blocks of sixteen tokens; a prefix that is shared is computed once.",
]


@pytest.fixture(scope="module")
def hf(cluster: Cluster) -> tuple:
    tok = AutoTokenizer.from_pretrained(cluster.model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(cluster.model_dir).eval()
    return tok, model


def hf_vector(hf: tuple, ids: list[int]) -> np.ndarray:
    """The last token's last hidden state (after the final norm), L2-normalised."""
    with torch.no_grad():
        out = hf[1](input_ids=torch.tensor([ids]), output_hidden_states=True)
    v = out.hidden_states[-1][0, -1].double()
    return (v / v.norm()).numpy()


def check(vectors: list, hf: tuple, ids: list[list[int]]) -> None:
    assert len(vectors) == len(ids)
    for v, want in zip(vectors, ids, strict=True):
        got = np.asarray(v, dtype=np.float64)
        assert got.shape == (128,)
        np.testing.assert_allclose(got, hf_vector(hf, want), atol=1e-4, rtol=0)


def test_vectors_match_hf_in_every_encoding(cluster: Cluster, hf: tuple) -> None:
    c = cluster.client(max_retries=0)
    ids = [hf[0](t).input_ids for t in TEXTS]
    # the client's default: it asks for base64 and decodes it (numpy) into floats
    r = c.embeddings.create(model=cluster.model_name, input=TEXTS)
    assert r.object == "list" and r.model == cluster.model_name
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in r.data)
    check([d.embedding for d in r.data], hf, ids)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    floats = c.embeddings.create(model=cluster.model_name, input=TEXTS, encoding_format="float")
    check([d.embedding for d in floats.data], hf, ids)
    b64 = c.embeddings.create(model=cluster.model_name, input=TEXTS[0], encoding_format="base64")
    raw = b64.data[0].embedding
    assert isinstance(raw, str)
    check([np.frombuffer(base64.b64decode(raw), dtype="<f4")], hf, ids[:1])
    assert b64.usage.prompt_tokens == len(ids[0])


def test_pooling_answers_the_embeddings(cluster: Cluster, hf: tuple) -> None:
    """vLLM's /pooling on an embedding model: each input's embedding under ``data``, in
    float32 or base64, keyed like /v1/embeddings; another task is a 400."""
    ids = [hf[0](t).input_ids for t in TEXTS]
    body = {"model": cluster.model_name, "input": TEXTS}
    r = httpx.post(f"{cluster.url}/pooling", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["id"].startswith("pool-")
    assert [d["index"] for d in out["data"]] == list(range(len(TEXTS)))
    assert {d["object"] for d in out["data"]} == {"pooling"}
    check([d["data"] for d in out["data"]], hf, ids)
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)),
                            "total_tokens": sum(map(len, ids)), "completion_tokens": 0}  # fmt: skip
    b64 = httpx.post(f"{cluster.url}/pooling", json={**body, "encoding_format": "base64"}).json()
    check([np.frombuffer(base64.b64decode(d["data"]), dtype="<f4") for d in b64["data"]], hf,
          ids)  # fmt: skip
    bad = httpx.post(f"{cluster.url}/pooling", json={**body, "task": "classify"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"


def test_token_ids_order_and_chat_input(cluster: Cluster, hf: tuple) -> None:
    c = cluster.client(max_retries=0)
    ids = [hf[0](t).input_ids for t in TEXTS]
    many = [ids[i % len(ids)][: 3 + i] for i in range(40)]  # more inputs than run at once
    r = c.embeddings.create(model=cluster.model_name, input=many, encoding_format="float")
    assert [d.index for d in r.data] == list(range(40))
    check([d.embedding for d in r.data], hf, many)
    assert r.usage.prompt_tokens == sum(len(i) for i in many)
    one = c.embeddings.create(model=cluster.model_name, input=ids[1], encoding_format="float")
    check([one.data[0].embedding], hf, [ids[1]])
    # vLLM's chat form: rendered by the chat template, no generation prompt
    msgs = [{"role": "user", "content": TEXTS[0]}]
    chat = httpx.post(f"{cluster.url}/v1/embeddings",
                      json={"model": cluster.model_name, "messages": msgs}).json()  # fmt: skip
    rendered = hf[0].apply_chat_template(msgs, add_generation_prompt=False, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    check([chat["data"][0]["embedding"]], hf, [rendered])
    assert chat["usage"]["prompt_tokens"] == len(rendered)


def test_long_inputs_dimensions_and_bad_input_are_400s(cluster: Cluster, hf: tuple) -> None:
    c = cluster.client(max_retries=0)
    ids = [3 + i % 400 for i in range(2049)]  # the tiny model's window is 2048 tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=cluster.model_name, input=[[1, 2], ids])
    err = e.value.body
    assert (err["code"], err["param"]) == ("context_length_exceeded", "input"), err
    cut = c.embeddings.create(model=cluster.model_name, input=ids, encoding_format="float",
                              extra_body={"truncate_prompt_tokens": 40})  # fmt: skip
    check([cut.data[0].embedding], hf, [ids[:40]])
    assert cut.usage.prompt_tokens == 40
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=cluster.model_name, input="x", dimensions=16)
    assert e.value.body["param"] == "dimensions" and "matryoshka" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=cluster.model_name, input=[[1, 99999]])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="no-such-model", input="x")
    m = httpx.get(f"{cluster.url}/metrics").text
    assert 'conveyor_requests_total{endpoint="/v1/embeddings",status="400"}' in m
    counted = [line for line in m.splitlines() if line.startswith("conveyor_embedding_tokens")]
    assert counted and float(counted[0].split()[-1]) >= 40


def test_tokenize_and_detokenize_match_the_tokenizer(cluster: Cluster, hf: tuple) -> None:
    tok, url, name = hf[0], cluster.url, cluster.model_name
    for text in TEXTS + ["Über café 東京 🙂"]:
        r = httpx.post(f"{url}/tokenize", json={"model": name, "prompt": text,
                                                "return_token_strs": True}).json()  # fmt: skip
        want = tok(text).input_ids
        assert r == {"count": len(want), "max_model_len": 2048, "tokens": want,
                     "token_strs": tok.convert_ids_to_tokens(want)}  # fmt: skip
        plain = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert plain.json()["tokens"] == want[1:] and plain.json()["token_strs"] is None
        back = httpx.post(f"{url}/detokenize", json={"model": name, "tokens": want[1:]})
        assert back.json() == {"prompt": text}  # the round trip
        assert back.json()["prompt"] == tok.decode(want[1:])
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1, 5]}).json()["prompt"] == \
        tok.decode([1, 5])  # fmt: skip
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"model": name, "messages": msgs}).json()
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    # refusals: out of the vocabulary, neither or both inputs, an unknown model
    for path, body, status, param in [
        ("/detokenize", {"tokens": [1, 512]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/tokenize", {"model": name}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": msgs}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_a_mock_engine_refuses_embeddings(fresh_db: str, tiny_model_dir: Path,
                                          tmp_path: Path) -> None:  # fmt: skip
    """Through the real pipeline: the mock engine's worker ends the request with a refusal
    that the API answers 400, naming the endpoint; the API stays serving."""
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP="50")
    worker = start_worker("emb-mock-w", "generate", "emb-mock-w", env, tmp_path)
    with stop_on_error(worker):
        api, api_url = start_api("emb-mock-api", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{api_url}/health").status_code == 200, 60,
                 "a live worker", [worker, api])  # fmt: skip
        c = openai.OpenAI(base_url=f"{api_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model=tiny_model_dir.name, input=["one", "two"])
        err = e.value.body
        assert err["code"] == "unsupported_parameter" and err["type"] == "invalid_request_error"
        assert "mock engine does not serve embeddings (/v1/embeddings)" in err["message"]
        out = c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=2)
        assert out.usage.completion_tokens == 2  # the worker still serves completions
    finally:
        api.stop()
        worker.stop()


def test_disagg_mode_embeds_on_the_decode_pool(fresh_db: str, tiny_model_dir: Path,
                                               tmp_path: Path, hf: tuple) -> None:  # fmt: skip
    """In the P/D mode an embedding runs whole on a decode worker (the pool that runs whole
    requests), with the same vectors; the prefill worker never sees it."""
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    pre = start_worker("emb-pd-p", "prefill", "emb-pd-p", env, tmp_path)
    dec = start_worker("emb-pd-d", "decode", "emb-pd-d", env, tmp_path)
    with stop_on_error(pre, dec):
        api, api_url = start_api("emb-pd-api", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{api_url}/health").json()["workers"] ==
                 {"prefill": 1, "decode": 1}, 90, "P/D workers", [pre, dec, api])  # fmt: skip
        c = openai.OpenAI(base_url=f"{api_url}/v1", api_key="x", max_retries=0)
        r = c.embeddings.create(model=tiny_model_dir.name, input=TEXTS, encoding_format="float")
        check([d.embedding for d in r.data], hf, [hf[0](t).input_ids for t in TEXTS])
        served = dec.log.read_text().count("[embd-")
        assert served >= len(TEXTS), served
        assert "[embd-" not in pre.log.read_text()
    finally:
        for p in (api, dec, pre):
            p.stop()
