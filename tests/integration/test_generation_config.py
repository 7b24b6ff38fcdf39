"""The model's generation_config.json as the sampling defaults of requests that do not set
them (vLLM's ``--generation-config auto``), and ``--override-generation-config`` over it,
through the real pipeline: an API process reading a copy of the session cluster's model
whose generation config asks for greedy sampling and 5 new tokens, serving through the
session cluster's workers; the official openai client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster, base_env, start_api

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def greedy_model(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gen") / cluster.model_dir.name
    shutil.copytree(cluster.model_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update(temperature=0.0, top_k=50, max_new_tokens=5)  # top_k 50: HF's own default
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def apis(cluster: Cluster, greedy_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:  # fmt: skip
    """URLs of an API per setting, beside the session cluster's, on its workers."""
    logdir = tmp_path_factory.mktemp("gen-logs")
    procs, urls = [], {}
    for name, extra in (("auto", {}), ("override", {
            "CONVEYOR_OVERRIDE_GENERATION_CONFIG": '{"max_new_tokens": 3, "temperature": 1.5}'}),
            ("vllm", {"CONVEYOR_GENERATION_CONFIG": "vllm"})):  # fmt: skip
        env = base_env(cluster.redis_url, greedy_model,
                       CONVEYOR_SERVED_MODEL_NAME=cluster.model_name, **extra)  # fmt: skip
        p, urls[name] = start_api(f"gen-api-{name}", env, logdir)
        procs.append(p)
    yield urls
    for p in procs:
        p.stop()


def _chat(cluster: Cluster, url: str, **kw: object):  # type: ignore[no-untyped-def]
    c = cluster.client(max_retries=0)
    c.base_url = f"{url}/v1"  # type: ignore[assignment]
    return c.chat.completions.create(model=cluster.model_name, messages=MSGS, **kw)  # type: ignore[arg-type]


def test_the_models_generation_config_sets_what_a_request_leaves_out(
    cluster: Cluster, apis: dict[str, str]
) -> None:
    greedy = _chat(cluster, cluster.url, temperature=0, max_tokens=5).choices[0].message.content
    for _ in range(3):  # no temperature, no max_tokens: the model's greedy 5 tokens
        r = _chat(cluster, apis["auto"], seed=None)
        assert r.choices[0].message.content == greedy
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # a request's own fields win; max_new_tokens is only a default here
    assert _chat(cluster, apis["auto"], max_tokens=9).usage.completion_tokens == 9
    hot = {_chat(cluster, apis["auto"], temperature=1.5, seed=s).choices[0].message.content
           for s in range(4)}  # fmt: skip
    assert len(hot) > 1
    # the override: its temperature a default, its max_new_tokens a cap on every request
    r = _chat(cluster, apis["override"], max_tokens=9)
    assert r.usage.completion_tokens == 3
    outs = {_chat(cluster, apis["override"], seed=s).choices[0].message.content for s in range(4)}
    assert len(outs) > 1  # sampled at 1.5, not greedy
    # "vllm": OpenAI's defaults (sampled at 1.0, up to the context's end unless asked)
    outs = {_chat(cluster, apis["vllm"], max_tokens=5, seed=s).choices[0].message.content
            for s in range(4)}  # fmt: skip
    assert len(outs) > 1
