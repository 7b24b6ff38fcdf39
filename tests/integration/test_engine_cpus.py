"""CONVEYOR_ENGINE_CPUS: a worker pins its engine process to the CPUs it names (real
worker process, its heartbeat report read from a real redis-server)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import redis

from cluster.keys import worker_key
from tests.integration.conftest import base_env, start_worker, wait_for

pytestmark = pytest.mark.integration


def _affinity(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of ``pid`` may run on."""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            out[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:  # a thread that just ended
            continue
    return out


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not {0, 1} <= os.sched_getaffinity(0),
    reason="needs Linux and CPUs 0 and 1",
)
def test_the_engine_process_runs_only_on_the_cpus_it_is_given(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE_CPUS="0")
    worker = start_worker("w-pinned", "generate", "pinned", env, tmp_path)
    try:
        key = worker_key("generate", "pinned")
        wait_for(lambda: json.loads(r.get(key))["engine_pid"], 90, "its heartbeat", [worker])
        engine = int(json.loads(r.get(key))["engine_pid"])  # the worker's own report
        assert engine != worker.popen.pid
        threads = _affinity(engine)
        assert threads and all(cpus == {0} for cpus in threads.values()), threads
        # the worker's Celery side is not pinned: it keeps the CPUs it was started with
        celery = _affinity(worker.popen.pid)
        assert all(cpus == os.sched_getaffinity(0) for cpus in celery.values()), celery
    finally:
        worker.stop()
        r.flushdb()
