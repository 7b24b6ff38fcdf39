"""LoRA adapters on the vLLM engine: a ``conveyor worker --engine vllm`` behind the API,
against vLLM's own offline ``LLM.generate`` with the same ``LoRARequest``s.

* an adapter named at start (``CONVEYOR_LORA_MODULES``) and one loaded at runtime give
  vLLM's offline text, with base-model requests in flight beside them;
* vLLM's KV events for an adapter's blocks reach the router's index in the adapter's
  namespace (the hashes the API computes for that adapter's prompt), not the base model's.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.index import KVIndex
from kvbm.protocol import block_hashes, model_namespace
from tests.integration.conftest import Cluster, RedisDbs, wait_for
from tests.lora_util import ALL_PROJECTIONS, write_adapter
from tests.vllm.conftest import deploy, offline, vllm_env

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

LORA_OPTIONS = {"enable_lora": True, "max_loras": 8, "max_lora_rank": 16}  # as the worker's
LENGTHS = [3, 17, 40, 100]
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[1] + [rng.randrange(5, 500) for _ in range(n - 1)] for n in LENGTHS]


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {"ad1": write_adapter(llama_dir, d / "ad1", seed=1, targets=ALL_PROJECTIONS),
            "ad2": write_adapter(llama_dir, d / "ad2", seed=2, r=4, alpha=8,
                                 targets=["q_proj", "v_proj", "down_proj"])}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(vllm_dbs: RedisDbs, llama_dir: Path, adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:  # fmt: skip
    url = vllm_dbs.take(__name__)
    env = vllm_env(url, llama_dir, CONVEYOR_LORA_MODULES=f"ad1={adapters['ad1']}",
                   CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING="true")  # fmt: skip
    c = deploy(url, llama_dir, env, tmp_path_factory.mktemp("vllm-lora"), "lora")
    yield c
    for p in [c.api, *c.workers]:
        p.stop()


@pytest.fixture(scope="module")
def reference(llama_dir: Path, adapters: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:  # fmt: skip
    """vLLM's offline greedy outputs per model: the base, ad1 and ad2."""
    loras = {"base": None} | {n: {"name": n, "id": i + 1, "path": str(p)}
                              for i, (n, p) in enumerate(adapters.items())}  # fmt: skip
    reqs = [{"prompt_token_ids": p, "lora": lora,
             "params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
            for lora in loras.values() for p in _prompts()]  # fmt: skip
    outs = offline(llama_dir, reqs, tmp_path_factory.mktemp("offline"), options=LORA_OPTIONS)
    n = len(LENGTHS)
    got = {name: outs[i * n : (i + 1) * n] for i, name in enumerate(loras)}
    assert [o["text"] for o in got["ad1"]] != [o["text"] for o in got["base"]]
    return got


async def _texts(c: Cluster, jobs: list[tuple[str, list[int]]]) -> list[str]:
    client = c.async_client(max_retries=0, timeout=300)

    async def one(model: str, prompt: list[int]) -> str:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        assert r.model == model and r.usage.completion_tokens == MAX_TOKENS  # type: ignore[union-attr]
        return r.choices[0].text

    try:
        return await asyncio.gather(*(one(m, p) for m, p in jobs))
    finally:
        await client.close()


def test_adapters_equal_vllm_offline_beside_the_base_model(
    cluster: Cluster, adapters: dict[str, Path], reference: dict[str, list[dict]]
) -> None:
    load = httpx.post(f"{cluster.url}/v1/load_lora_adapter",
                      json={"lora_name": "ad2", "lora_path": str(adapters["ad2"])})  # fmt: skip
    assert load.status_code == 200, load.text
    names = ["base", "ad1", "ad2"]
    jobs = [(cluster.model_name if n == "base" else n, p) for n in names for p in _prompts()]
    got = asyncio.run(_texts(cluster, jobs))
    want = [o["text"] for n in names for o in reference[n]]
    assert got == want


def test_an_adapters_kv_events_are_indexed_in_its_namespace(cluster: Cluster) -> None:
    rng = random.Random(41)
    prompt = [1] + [rng.randrange(5, 500) for _ in range(127)]
    cluster.client().completions.create(model="ad1", prompt=prompt, max_tokens=2,
                                        temperature=0)  # fmt: skip
    index = KVIndex(redis.Redis.from_url(cluster.redis_url), "generate")
    worker = "lora-w"
    ad1 = block_hashes(prompt, 16, model_namespace(cluster.model_name, "ad1"))
    base = block_hashes(prompt, 16, model_namespace(cluster.model_name))
    # vLLM caches whole 32-token blocks (four here); the router hashes 16-token ones
    wait_for(lambda: index.overlaps(ad1).get(worker) == 8, 15, "the adapter's blocks indexed")
    assert index.overlaps(base).get(worker, 0) == 0
    again = cluster.client().completions.create(model="ad1", prompt=prompt + [9] * 8,
                                                max_tokens=2, temperature=0)  # fmt: skip
    assert again.usage.prompt_tokens_details.cached_tokens == 128  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError):  # embeddings run the base model only
        cluster.client().embeddings.create(model="ad1", input="hi")
    assert json.loads(httpx.get(f"{cluster.url}/v1/models").text)["data"][1]["parent"] == \
        cluster.model_name  # fmt: skip
