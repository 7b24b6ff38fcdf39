"""Embeddings on the vLLM engine: a worker whose vLLM runs the model for pooling
(``CONVEYOR_VLLM__RUNNER=pooling``, as ``vllm serve --runner pooling``) serves
``/v1/embeddings`` through ``AsyncLLM.encode``.

A real ``conveyor worker --engine vllm`` behind the API, the official ``openai`` client,
and vLLM's own offline ``LLM.embed`` (its pooling runner, same checkpoint and options) as
the reference:

* the vectors of several inputs at once equal vLLM's own, as floats and as base64;
* ``use_activation=False`` gives the vector before normalisation (its direction the same);
* generation on that worker is a 400 saying it serves embeddings only;
* a sequence classifier's ``/classify`` on such a worker gives Hugging Face's
  ``LlamaForSequenceClassification`` probabilities (vLLM's raw logits, the API's softmax).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest import Cluster, RedisDbs
from tests.vllm.conftest import VLLM_OPTIONS, deploy, offline, vllm_env
from workers.model_init import PRESETS, init_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

INPUTS = [[1, 22, 301, 17, 96, 450, 9, 31, 77], [1, 5] * 20, [1] + list(range(40, 110))]


@pytest.fixture(scope="module")
def pooling_cluster(
    vllm_dbs: RedisDbs, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    url = vllm_dbs.take(__name__)
    env = {**vllm_env(url, llama_dir),
           "CONVEYOR_VLLM": json.dumps({**VLLM_OPTIONS, "runner": "pooling"})}  # fmt: skip
    c = deploy(url, llama_dir, env, tmp_path_factory.mktemp("vllm-embed"), "vllm-embed")
    yield c
    for p in (c.api, *c.workers):
        p.stop()


@pytest.fixture(scope="module")
def want(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    """vLLM's own vectors for INPUTS (offline, its pooling runner)."""
    outs = offline(llama_dir, [{"prompt_token_ids": ids} for ids in INPUTS],
                   tmp_path_factory.mktemp("embed-ref"), embed=True)  # fmt: skip
    return [o["embedding"] for o in outs]


def test_embeddings_equal_vllms_own(pooling_cluster: Cluster, want: list[list[float]]) -> None:
    client = pooling_cluster.client(timeout=120)
    r = client.embeddings.create(model=pooling_cluster.model_name, input=INPUTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == sum(len(ids) for ids in INPUTS)
    for d, ref in zip(r.data, want, strict=True):
        assert len(d.embedding) == len(ref) > 0
        np.testing.assert_allclose(d.embedding, ref, rtol=1e-4, atol=1e-5)
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-4)  # normalised
    # base64: the same float32 values, little-endian
    b = client.embeddings.create(model=pooling_cluster.model_name, input=INPUTS[0],
                                 encoding_format="base64")  # fmt: skip
    raw = b.data[0].embedding
    vec = np.frombuffer(base64.b64decode(raw if isinstance(raw, str) else ""), dtype="<f4")
    np.testing.assert_allclose(vec, want[0], rtol=1e-4, atol=1e-5)


def test_use_activation_false_keeps_the_raw_vector(
    pooling_cluster: Cluster, want: list[list[float]]
) -> None:
    client = pooling_cluster.client(timeout=120)
    r = client.embeddings.create(model=pooling_cluster.model_name, input=INPUTS[1],
                                 extra_body={"use_activation": False})  # fmt: skip
    raw = np.asarray(r.data[0].embedding)
    norm = float(np.linalg.norm(raw))
    assert not math.isclose(norm, 1.0, rel_tol=1e-3), norm  # not normalised ...
    np.testing.assert_allclose(raw / norm, want[1], rtol=1e-4, atol=1e-5)  # ... same direction


def test_generation_on_a_pooling_worker_is_a_400(pooling_cluster: Cluster) -> None:
    client = pooling_cluster.client(timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=pooling_cluster.model_name, prompt="Hi", max_tokens=2)
    assert e.value.code == "unsupported_parameter"
    assert "/v1/embeddings only" in e.value.message
    for stream in (False, True):  # a chat too, streamed or not: never a hang or a 500
        with pytest.raises(openai.BadRequestError):
            out = client.chat.completions.create(
                model=pooling_cluster.model_name, max_tokens=2, stream=stream,
                messages=[{"role": "user", "content": "Hi"}],
            )  # fmt: skip
            if stream:
                list(out)  # type: ignore[call-overload]


# --------------------------------------------------------------------------- classifier
@pytest.fixture(scope="module")
def classifier_cluster(
    vllm_dbs: RedisDbs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A worker whose vLLM runs the tiny two-label LlamaForSequenceClassification for
    pooling (vLLM's classify task)."""
    model = init_model(tmp_path_factory.mktemp("models") / "tiny-classifier",
                       PRESETS["classifier"])  # fmt: skip
    url = vllm_dbs.take(f"{__name__}.classifier")
    env = {**vllm_env(url, model),
           "CONVEYOR_VLLM": json.dumps({**VLLM_OPTIONS, "runner": "pooling"})}  # fmt: skip
    c = deploy(url, model, env, tmp_path_factory.mktemp("vllm-cls"), "vllm-cls")
    yield c
    for p in (c.api, *c.workers):
        p.stop()


def test_classify_on_vllm_gives_hugging_faces_probabilities(classifier_cluster: Cluster) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(classifier_cluster.model_dir).eval()
    with torch.no_grad():
        logits = [hf(input_ids=torch.tensor([ids])).logits[0].double().numpy() for ids in INPUTS]
    r = httpx.post(f"{classifier_cluster.url}/classify", json={"input": INPUTS}, timeout=120)
    assert r.status_code == 200, r.text
    for d, x in zip(r.json()["data"], logits, strict=True):
        probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        np.testing.assert_allclose(d["probs"], probs, rtol=1e-4, atol=1e-5)
        assert d["label"] == ["negative", "positive"][int(np.argmax(probs))]
    raw = httpx.post(f"{classifier_cluster.url}/classify",
                     json={"input": INPUTS[0], "use_activation": False}, timeout=120)  # fmt: skip
    np.testing.assert_allclose(raw.json()["data"][0]["probs"], logits[0], rtol=1e-4, atol=1e-5)
    # what it does not serve: a clear 400
    with pytest.raises(openai.BadRequestError) as e:
        classifier_cluster.client(timeout=60).completions.create(
            model=classifier_cluster.model_name, prompt="Hi", max_tokens=2)  # fmt: skip
    assert e.value.body["param"] == "model"  # type: ignore[index]
