"""LoRA adapters through the real pipeline (Redis, Celery workers, the API, the official
client): an adapter is a model of ``/v1/models``; its greedy tokens equal Hugging Face
``generate`` through PEFT's loading of the same files, aggregated and disaggregated, with
base and adapter requests running side by side; its KV blocks are named apart in the
workers and in the router's index; adapters loaded and unloaded at runtime reach every API
replica at once; bad adapters and names get OpenAI-style errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.integration.conftest import (
    Proc,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.lora_util import peft_greedy, write_adapter

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
PROMPTS = [
    [1, 78, 183, 256, 279, 154, 50, 268, 428, 158, 111, 366],
    [1] + [(7 * i) % 500 + 5 for i in range(40)],  # two full blocks of 16
    [1, 5, 6, 7, 300, 301],
]


@dataclass
class Deployment:
    urls: list[str]  # API replicas
    procs: list[Proc]
    adapters: dict[str, Path]
    redis_url: str
    model_dir: Path

    @property
    def model(self) -> str:
        return self.model_dir.name

    def client(self, i: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[i]}/v1", api_key="x", max_retries=0)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {"ad1": write_adapter(tiny_model_dir, d / "ad1", seed=1),
            "ad2": write_adapter(tiny_model_dir, d / "ad2", seed=2, r=4, alpha=8,
                                 targets=["q_proj", "v_proj", "down_proj"])}  # fmt: skip


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, list[list[int]]]:
    """PEFT's greedy tokens per model name (the base model's too)."""
    out = {"base": peft_greedy(tiny_model_dir, None, PROMPTS, MAX_TOKENS)}
    for name, path in adapters.items():
        out[name] = peft_greedy(tiny_model_dir, path, PROMPTS, MAX_TOKENS)
    assert out["ad1"] != out["base"] != out["ad2"]  # the adapters change the output
    return out


def _deploy(name: str, url: str, model_dir: Path, logdir: Path, adapters: dict[str, Path],
            pools: list[str], apis: int, **extra: str) -> Deployment:  # fmt: skip
    env = base_env(url, model_dir, CONVEYOR_LORA_MODULES=f"ad1={adapters['ad1']}",
                   CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING="true", **extra)  # fmt: skip
    procs = [start_worker(f"{name}-{p}{i}", p, f"{name}-{p[0]}{i}", env, logdir)
             for i, p in enumerate(pools)]  # fmt: skip
    urls = []
    with stop_on_error(*procs):
        for i in range(apis):
            api, u = start_api(f"{name}-api{i}", env, logdir)
            procs.append(api)
            urls.append(u)
        health = lambda: httpx.get(f"{urls[0]}/health", timeout=1).json()  # noqa: E731
        wait_for(lambda: sum(health().get("workers", {}).values()) == len(pools), 90,
                 f"{name} workers up", procs)  # fmt: skip
    return Deployment(urls, procs, adapters, url, model_dir)


@pytest.fixture(scope="module")
def agg(redis_dbs: RedisDbs, tiny_model_dir: Path, adapters: dict[str, Path],
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:  # fmt: skip
    """Two generate workers and two API replicas; ad1 from the start (lora_modules)."""
    d = _deploy("lora", redis_dbs.take(f"{__name__}[agg]"), tiny_model_dir,
                tmp_path_factory.mktemp("lora-agg"), adapters, ["generate"] * 2, 2)  # fmt: skip
    yield d
    d.stop()


def _token_strings(model_dir: Path, ids: list[int]) -> list[str]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


async def _complete(url: str, jobs: list[tuple[str, list[int]]]) -> list[list[str]]:
    """Each (model, prompt) completed greedily, all at once: the tokens' strings."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    async def one(model: str, prompt: list[int]) -> list[str]:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        assert r.model == model
        return list(r.choices[0].logprobs.tokens)  # type: ignore[union-attr, arg-type]

    try:
        return await asyncio.gather(*(one(m, p) for m, p in jobs))
    finally:
        await client.close()


def _check_tokens(d: Deployment, model_dir: Path, expected: dict, names: list[str]) -> None:
    jobs = [(d.model if n == "base" else n, p) for p in PROMPTS for n in names]
    got = asyncio.run(_complete(d.urls[0], jobs))
    want = [_token_strings(model_dir, expected[n][i]) for i in range(len(PROMPTS)) for n in names]
    assert got == want


# ----------------------------------------------------------------------------------------
def test_models_lists_the_adapters_and_runtime_loads_reach_every_replica(
    agg: Deployment, tiny_model_dir: Path, expected: dict
) -> None:
    a, b = agg.client(0), agg.client(1)
    cards = {m.id: m for m in a.models.list().data}
    assert set(cards) == {agg.model, "ad1"}
    assert cards["ad1"].model_extra["parent"] == agg.model  # type: ignore[index]
    assert cards["ad1"].model_extra["root"] == str(agg.adapters["ad1"])  # type: ignore[index]
    assert cards[agg.model].model_extra["parent"] is None  # type: ignore[index]
    assert b.models.retrieve("ad1").id == "ad1"
    with pytest.raises(openai.NotFoundError):
        b.models.retrieve("ad2")

    load = httpx.post(f"{agg.urls[0]}/v1/load_lora_adapter",
                      json={"lora_name": "ad2", "lora_path": str(agg.adapters["ad2"])})  # fmt: skip
    assert load.status_code == 200 and "ad2" in load.text
    assert {m.id for m in b.models.list().data} == {agg.model, "ad1", "ad2"}
    # an Anthropic client gets Anthropic's model objects, a page at a time
    ac = anthropic.Anthropic(base_url=agg.urls[1], api_key="x", max_retries=0)
    page = ac.models.list(limit=2)
    assert [m.id for m in page.data] == [agg.model, "ad1"] and page.has_more
    assert page.data[0].type == "model" and page.data[0].created_at.year >= 2026
    assert [m.id for m in ac.models.list(limit=2)] == [agg.model, "ad1", "ad2"]  # paged on
    assert [m.id for m in ac.models.list(after_id="ad1").data] == ["ad2"]
    assert [m.id for m in ac.models.list(before_id="ad2", limit=1).data] == ["ad1"]
    assert ac.models.retrieve("ad2").id == "ad2"
    with pytest.raises(anthropic.NotFoundError) as nf:
        ac.models.retrieve("nope")
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # the other replica serves it at once, with PEFT's tokens
    r = b.completions.create(model="ad2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                             temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})  # fmt: skip
    want = _token_strings(tiny_model_dir, expected["ad2"][0])
    assert r.choices[0].logprobs.tokens == want  # type: ignore[union-attr]

    unload = httpx.post(f"{agg.urls[1]}/v1/unload_lora_adapter", json={"lora_name": "ad2"})
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        a.chat.completions.create(model="ad2", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_adapter_tokens_equal_peft_beside_the_base_model(
    agg: Deployment, tiny_model_dir: Path, expected: dict
) -> None:
    body = {"lora_name": "ad2", "lora_path": str(agg.adapters["ad2"]), "load_inplace": True}
    assert httpx.post(f"{agg.urls[1]}/v1/load_lora_adapter", json=body).status_code == 200
    # nine requests at once over two workers: batches mix the base model and two adapters
    _check_tokens(agg, tiny_model_dir, expected, ["base", "ad1", "ad2"])
    # chat and streaming reach the adapter too
    c = agg.client(1)
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = c.chat.completions.create(model="ad1", messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    base = c.chat.completions.create(model=agg.model, messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    stream = c.chat.completions.create(model="ad1", messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                       stream=True)  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert whole.model == "ad1" and text == whole.choices[0].message.content
    assert whole.choices[0].message.content != base.choices[0].message.content


def test_an_adapters_prefix_is_cached_under_its_own_name(agg: Deployment) -> None:
    """A prompt the base model cached is not a hit for an adapter; the adapter's second
    request finds its own blocks (the router's index names them as the engine does)."""
    c = agg.client(0)
    prompt = [1] + [(11 * i) % 480 + 9 for i in range(40)]
    cached = []
    for model in [agg.model, agg.model, "ad1", "ad1"]:
        r = c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
    assert cached == [0, 32, 0, 32]


def test_bad_adapters_and_names_get_clear_errors(
    agg: Deployment, tiny_model_dir: Path, tmp_path: Path
) -> None:
    post = lambda path, body, i=0: httpx.post(f"{agg.urls[i]}{path}", json=body)  # noqa: E731

    def err(r: httpx.Response, status: int, param: str | None) -> str:
        assert r.status_code == status, r.text
        body = r.json()["error"]
        assert body["param"] == param and body["type"] == "invalid_request_error"
        return body["message"]

    load = "/v1/load_lora_adapter"
    ad1 = str(agg.adapters["ad1"])
    assert "already loaded" in err(post(load, {"lora_name": "ad1", "lora_path": ad1}), 400,
                                   "lora_name")  # fmt: skip
    empty = {"lora_name": "x", "lora_path": str(tmp_path)}
    assert "adapter_config.json" in err(post(load, empty), 400, "lora_path")
    big = write_adapter(tiny_model_dir, tmp_path / "big", seed=4, r=32)
    assert "max_lora_rank=16" in err(post(load, {"lora_name": "big", "lora_path": str(big)}),
                                     400, "lora_path")  # fmt: skip
    assert "base model" in err(post(load, {"lora_name": agg.model, "lora_path": ad1}), 400,
                               "lora_name")  # fmt: skip
    assert "adapter name" in err(post(load, {"lora_name": "a b", "lora_path": ad1}), 400,
                                 "lora_name")  # fmt: skip
    err(post("/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, "lora_name")
    err(post(load, {"lora_name": "x"}), 400, "lora_path")
    # an adapter where only the base model serves
    assert "LoRA adapter" in err(post("/v1/embeddings", {"model": "ad1", "input": "hi"}),
                                 400, "model")  # fmt: skip
    err(post("/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "model")  # fmt: skip


def test_runtime_updates_are_off_unless_allowed(agg: Deployment, tmp_path: Path) -> None:
    # ad2, loaded at runtime through a replica that allows it, is in the shared registry
    body = {"lora_name": "ad2", "lora_path": str(agg.adapters["ad2"]), "load_inplace": True}
    assert httpx.post(f"{agg.urls[0]}/v1/load_lora_adapter", json=body).status_code == 200
    env = base_env(agg.redis_url, agg.model_dir, CONVEYOR_LORA_MODULES="")
    api, url = start_api("lora-api-fixed", env, tmp_path)
    try:
        body = {"lora_name": "ad3", "lora_path": str(agg.adapters["ad2"])}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 404 and "CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING" in r.text
        # A start whose lora_modules no longer names ad1 unregisters it (the registry in
        # Redis outlives restarts; a dropped adapter must not stay served), for every
        # replica; what was loaded at runtime stays, and is served here too.
        ids = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert ids == {agg.model, "ad2"}
        assert {m.id for m in agg.client(1).models.list().data} == {agg.model, "ad2"}
    finally:
        api.stop()
    # a start that names it again serves it again
    env = base_env(agg.redis_url, agg.model_dir, CONVEYOR_LORA_MODULES=f"ad1={agg.adapters['ad1']}")
    api, url = start_api("lora-api-again", env, tmp_path)
    try:
        ids = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert ids == {agg.model, "ad1", "ad2"}
    finally:
        api.stop()


@pytest.fixture(scope="module")
def disagg(redis_dbs: RedisDbs, tiny_model_dir: Path, adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:  # fmt: skip
    """A prefill and a decode worker, the KV over the Redis backend, every prompt
    disaggregated."""
    d = _deploy("lora-pd", redis_dbs.take(f"{__name__}[disagg]"), tiny_model_dir,
                tmp_path_factory.mktemp("lora-pd"), adapters, ["prefill", "decode"], 1,
                CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
                CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    yield d
    d.stop()


def test_disaggregated_adapter_tokens_equal_peft(
    disagg: Deployment, tiny_model_dir: Path, expected: dict
) -> None:
    """The prefill worker and the decode worker both run the adapter: the decode worker
    goes on from KV the adapter computed, and its tokens are PEFT's."""
    _check_tokens(disagg, tiny_model_dir, expected, ["base", "ad1"])
