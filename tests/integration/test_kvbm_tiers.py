"""KVBM tiers through the real pipeline: `conveyor worker` processes with host memory (G2)
and disk (G3) tiers, the API over HTTP, the official openai client.

A prompt answered once, pushed out of the worker's engine pool (G1) by other traffic, then
asked again, is onboarded from G2 or from G3 and answered with exactly the text of the
first (cold, recomputed) answer, its onboarded tokens counted in
``usage.prompt_tokens_details.cached_tokens``; a damaged disk block is a counted miss with
the same text; a worker restarted on its disk dir announces the blocks it found there and
serves its first request from them; disaggregated serving onboards on the prefill worker;
every tier's accounting is back at rest afterwards; /metrics exports the counters."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from cluster.index import KVIndex
from cluster.keys import worker_key
from kvbm.disk import HEADER_BYTES
from kvbm.protocol import G3, block_hashes, model_namespace
from tests.integration.conftest import (
    Proc,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

_rng = random.Random(2022)


def _prompt(n: int = 300) -> list[int]:
    return [1] + [_rng.randrange(5, 500) for _ in range(n - 1)]


A, B, C, D = (_prompt() for _ in range(4))
FLOODS = [_prompt() for _ in range(12)]
E = _prompt()  # asked with logprobs
FULL = (300 - 1) // 16 * 16  # prompt tokens a hit can cover: every full block but a token


@dataclass
class Deployment:
    url: str
    redis_url: str
    model: str
    disk_dir: Path
    logdir: Path
    env: dict[str, str]
    workers: list[Proc]
    api: Proc

    def ask(self, prompt: list[int], n: int = 12) -> tuple[str, int]:
        c = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = c.completions.create(model=self.model, prompt=prompt, max_tokens=n, temperature=0,
                                 extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.completion_tokens == n
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens or 0

    def flood(self, k: int) -> None:
        for p in FLOODS[:k]:
            self.ask(p, 2)

    def reports(self, pool: str = "generate") -> dict[str, dict]:
        r = redis.Redis.from_url(self.redis_url)
        out = {}
        for key in r.scan_iter(worker_key(pool, "*")):
            raw = r.get(key)
            if raw:
                info = json.loads(raw)
                out[info["worker_id"]] = info
        return out

    def metric(self, line_start: str) -> float:
        for ln in httpx.get(f"{self.url}/metrics").text.splitlines():
            if ln.startswith(line_start):
                return float(ln.split()[-1])
        return 0.0

    def stop(self) -> None:
        for p in (self.api, *self.workers):
            p.stop()


def _tier_env(redis_url: str, model_dir: Path, disk_dir: Path, **extra: str) -> dict[str, str]:
    return base_env(
        redis_url, model_dir,
        CONVEYOR_NUM_KV_BLOCKS="48", CONVEYOR_MAX_MODEL_LEN="512",
        CONVEYOR_KVBM_CPU_CACHE_BLOCKS="128", CONVEYOR_KVBM_DISK_CACHE_BLOCKS="1024",
        CONVEYOR_KVBM_DISK_DIR=str(disk_dir), CONVEYOR_KVBM_DISK_OFFLOAD_FILTER="false",
        **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def agg(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    url = redis_dbs.take(__name__)
    logdir = tmp_path_factory.mktemp("kvbm-agg")
    disk = tmp_path_factory.mktemp("kvbm-disk")
    env = _tier_env(url, tiny_model_dir, disk)
    w = start_worker("tier-w1", "generate", "tier-w1", env, logdir)
    with stop_on_error(w):
        api, api_url = start_api("tier-api", env, logdir)
    d = Deployment(api_url, url, tiny_model_dir.name, disk, logdir, env, [w], api)
    with stop_on_error(w, api):
        wait_for(lambda: httpx.get(f"{api_url}/health").json()["workers"]["generate"] == 1,
                 90, "tier worker", [w, api])  # fmt: skip
    yield d
    d.stop()


def _disk_path(d: Deployment, prompt: list[int], block: int) -> Path:
    h = block_hashes(prompt, 16, model_namespace(d.model))[block]
    (slot,) = (d.disk_dir / f"{model_namespace(d.model):016x}").iterdir()
    return slot / f"{h:016x}.kv"


def _at_rest(d: Deployment, worker: str) -> bool:
    info = d.reports()[worker]
    kv = info["kvbm"]
    return (info["blocks_used"] == 0 and info["loading"] == 0
            and kv["host_blocks_pinned"] == 0 and kv["disk_blocks_pinned"] == 0
            and kv["host_blocks_used"] <= kv["host_blocks_total"] == 128
            and kv["disk_blocks_used"] <= kv["disk_blocks_total"] == 1024)  # fmt: skip


# ----------------------------------------------------------------------------------------


def test_g2_then_g3_onboarding_answers_as_the_cold_run(agg: Deployment) -> None:
    cold_a, cached = agg.ask(A)
    assert cached == 0
    cold_b, _ = agg.ask(B)
    agg.flood(3)  # A and B leave G1 (48 blocks); host memory (128 blocks) keeps them
    lab = '{pool="generate",worker="tier-w1"}'
    h2d = agg.metric(f"conveyor_kvbm_onboard_blocks_h2d_total{lab}")
    assert agg.ask(A) == (cold_a, FULL)
    wait_for(lambda: agg.metric(f"conveyor_kvbm_onboard_blocks_h2d_total{lab}") >= h2d + 10,
             10, "G2 onboard counted")  # fmt: skip
    agg.flood(12)  # now B has left host memory too; the disk (filter off) still has it
    info = agg.reports()["tier-w1"]["kvbm"]
    assert info["host_blocks_used"] <= 128
    assert agg.ask(B) == (cold_b, FULL)
    wait_for(lambda: agg.metric(f"conveyor_kvbm_onboard_blocks_d2d_total{lab}") >= 10,
             10, "G3 onboard counted")  # fmt: skip
    m = 'conveyor_kvbm_matched_tokens_total{pool="generate",tier="g3",worker="tier-w1"}'
    assert agg.metric(m) >= FULL
    assert agg.metric('conveyor_kvbm_host_cache_hit_rate{pool="generate",worker="tier-w1"}') > 0
    assert agg.metric('conveyor_kvbm_onboard_latency_seconds_count{pool="generate",'
                      'worker="tier-w1"}') >= 2  # fmt: skip
    wait_for(lambda: _at_rest(agg, "tier-w1"), 10, "every tier at rest")


def test_g2_onboarding_gives_the_cold_runs_logprobs(agg: Deployment) -> None:
    c = openai.OpenAI(base_url=f"{agg.url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask() -> tuple[Any, int]:
        r = c.completions.create(model=agg.model, prompt=E, max_tokens=8, temperature=0,
                                 logprobs=4, extra_body={"ignore_eos": True})  # fmt: skip
        return r.choices[0].logprobs, r.usage.prompt_tokens_details.cached_tokens or 0

    cold, cached = ask()
    assert cached == 0
    agg.flood(3)  # E leaves G1; host memory keeps it
    warm, cached = ask()
    assert cached == FULL  # onboarded from G2
    assert warm.tokens == cold.tokens
    assert warm.token_logprobs == pytest.approx(cold.token_logprobs, abs=1e-3)
    assert [list(t) for t in warm.top_logprobs] == [list(t) for t in cold.top_logprobs]
    wait_for(lambda: _at_rest(agg, "tier-w1"), 10, "every tier at rest")


@pytest.mark.parametrize("how", ["corrupt", "truncated", "deleted"])
def test_a_damaged_disk_block_is_a_counted_miss_with_the_same_text(
    agg: Deployment, how: str
) -> None:
    prompt = {"corrupt": C, "truncated": D, "deleted": _prompt()}[how]
    cold, _ = agg.ask(prompt)
    agg.flood(12)  # out of G1 and G2; on disk
    wait_for(lambda: _disk_path(agg, prompt, 5).exists(), 10, "block on disk")
    path = _disk_path(agg, prompt, 5)
    raw = bytearray(path.read_bytes())
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(bytes(raw[: HEADER_BYTES + 3]))
    else:
        raw[HEADER_BYTES + 64] ^= 0x10
        path.write_bytes(bytes(raw))
    key = 'conveyor_kvbm_onboard_failures_total{pool="generate",worker="tier-w1"}'
    before = agg.metric(key)
    assert agg.ask(prompt) == (cold, 5 * 16)  # blocks 0-4 from disk, the rest recomputed
    wait_for(lambda: agg.metric(key) == before + 1, 10, "the miss counted")
    wait_for(lambda: _at_rest(agg, "tier-w1"), 10, "every tier at rest")


def test_a_restarted_worker_serves_its_first_request_from_its_disk(agg: Deployment) -> None:
    cold, _ = agg.ask(A)  # (on disk since the first test)
    old = agg.workers.pop()
    old.stop()
    w = start_worker("tier-w2", "generate", "tier-w2", agg.env, agg.logdir)
    agg.workers.append(w)
    wait_for(lambda: httpx.get(f"{agg.url}/health").json()["workers"]["generate"] == 1
             and "tier-w2" in agg.reports(), 90, "restarted worker", [w])  # fmt: skip
    hs = block_hashes(A, 16, model_namespace(agg.model))
    idx = KVIndex(redis.Redis.from_url(agg.redis_url), "generate")
    wait_for(lambda: set(hs) <= idx.worker_blocks("tier-w2", G3), 10, "G3 blocks announced")
    assert agg.reports()["tier-w2"]["steps"] == 0  # nothing ran there yet
    assert agg.ask(A) == (cold, FULL)
    m = 'conveyor_kvbm_matched_tokens_total{pool="generate",tier="g3",worker="tier-w2"}'
    wait_for(lambda: agg.metric(m) == FULL, 10, "matched on disk")
    wait_for(lambda: _at_rest(agg, "tier-w2"), 10, "every tier at rest")


# ------------------------------------------------------------------------- disaggregated


@pytest.fixture(scope="module")
def disagg(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    url = redis_dbs.take(__name__)
    logdir = tmp_path_factory.mktemp("kvbm-disagg")
    disk = tmp_path_factory.mktemp("kvbm-disagg-disk")
    env = _tier_env(url, tiny_model_dir, disk, CONVEYOR_MODE="disagg",
                    CONVEYOR_KV_TRANSFER="redis",
                    CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    pre = start_worker("tier-p", "prefill", "tier-p", env, logdir)
    dec = start_worker("tier-d", "decode", "tier-d", env, logdir)
    with stop_on_error(pre, dec):
        api, api_url = start_api("tier-dapi", env, logdir)
    d = Deployment(api_url, url, tiny_model_dir.name, disk, logdir, env, [pre, dec], api)
    with stop_on_error(pre, dec, api):
        wait_for(lambda: httpx.get(f"{api_url}/health").json()["workers"]
                 == {"prefill": 1, "decode": 1}, 90, "disagg workers", [pre, dec, api])  # fmt: skip
    yield d
    d.stop()


def test_disaggregated_prefill_onboards_and_answers_as_the_cold_run(
    disagg: Deployment, agg: Deployment
) -> None:
    cold, cached = disagg.ask(A)
    assert cached == 0
    assert cold == agg.ask(A)[0]  # the same text as aggregated serving
    disagg.flood(3)
    assert disagg.ask(A) == (cold, FULL)  # the decode worker's usage counts the prefill's hit
    wait_for(lambda: disagg.reports("prefill")["tier-p"]["kvbm"]["onboard_blocks"]["h2d"] > 0,
             10, "prefill onboarded from host memory")  # fmt: skip

    def at_rest() -> bool:
        p, dec = disagg.reports("prefill")["tier-p"], disagg.reports("decode")["tier-d"]
        return (p["blocks_used"] == 0 and p["blocks_pinned"] == 0 and dec["blocks_used"] == 0
                and dec["loading"] == 0 and p["kvbm"]["host_blocks_pinned"] == 0)  # fmt: skip

    wait_for(at_rest, 10, "both sides at rest")
