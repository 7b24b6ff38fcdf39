"""The compose stack under test, driven through the docker and docker compose CLIs.

``scripts/compose/test-compose.sh`` builds the image and hands the stack over through the
environment: the project name, the compose files, the env file (.env.example with fresh
secrets), and the host ports it picked; every ``docker compose`` here runs with the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

# how long `up --wait` may take to get every service healthy (the bound)
HEALTHY_WITHIN_S = 300


def env_file_values(path: str) -> dict[str, str]:
    """KEY=VALUE lines of an env file (comments and blanks skipped)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                out[key.strip()] = value.strip()
    return out


@dataclass
class Stack:
    project: str
    files: list[str]
    env_file: str
    api_port: int
    flower_port: int
    mode: str = "agg"
    dotenv: dict[str, str] = field(default_factory=dict)  # the env file's values

    @classmethod
    def from_env(cls) -> Stack:
        e = os.environ
        env_file = e["CONVEYOR_COMPOSE_ENV_FILE"]
        return cls(
            project=e["CONVEYOR_COMPOSE_PROJECT"],
            files=e["CONVEYOR_COMPOSE_FILES"].split(":"),
            env_file=env_file,
            api_port=int(e["CONVEYOR_PORT"]),
            flower_port=int(e["CONVEYOR_FLOWER_PORT"]),
            dotenv=env_file_values(env_file),
        )

    # ------------------------------------------------------------------ compose CLI
    def compose(
        self, *args: str, timeout: float = 600, check: bool = True, profiles: Iterable[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-p", self.project, "--env-file", self.env_file]
        for f in self.files:
            argv += ["-f", f]
        for p in profiles:
            argv += ["--profile", p]
        env = {**os.environ, "CONVEYOR_MODE": self.mode}
        r = subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return r

    def up(
        self, mode: str = "agg", profiles: Iterable[str] = (), scale: dict[str, int] | None = None
    ) -> float:
        """Bring the stack to ``mode`` with these profiles and replica counts, every service
        healthy (``up --wait``); returns the seconds it took."""
        self.mode = mode
        args = ["up", "-d", "--no-build", "--wait", "--wait-timeout", str(HEALTHY_WITHIN_S)]
        for svc, n in (scale or {}).items():
            args += ["--scale", f"{svc}={n}"]
        t0 = time.monotonic()
        r = self.compose(*args, profiles=profiles, timeout=HEALTHY_WITHIN_S + 60, check=False)
        took = time.monotonic() - t0
        if r.returncode != 0:
            logs = self.compose("logs", "--tail", "30", check=False).stdout
            raise AssertionError(f"up {mode} {list(profiles)} {scale}: {r.stderr[-2000:]}\n{logs}")
        return took

    # ------------------------------------------------------------------ containers
    def containers(self, service: str | None = None, all_: bool = False) -> list[dict[str, Any]]:
        """``docker inspect`` of the project's containers (of one service), running only
        unless ``all_``."""
        flt = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            flt += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = subprocess.run(
            ["docker", "ps", "-q", *(["-a"] if all_ else []), *flt],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if not ids:
            return []
        out = subprocess.run(
            ["docker", "inspect", *ids], capture_output=True, text=True, check=True
        ).stdout
        return json.loads(out)

    def container_of_worker(self, worker_id: str) -> dict[str, Any]:
        """The container a worker runs in: its id is ``<hostname>-<pid>``, and a container's
        hostname is its short id."""
        host = worker_id.rsplit("-", 1)[0]
        found = [c for c in self.containers() if c["Config"]["Hostname"] == host]
        assert len(found) == 1, f"no single container with hostname {host}: {found}"
        return found[0]

    # ------------------------------------------------------------------ the API
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=timeout
        )

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def metric(self, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Samples of one metric from the API's /metrics (counters with or without their
        ``_total`` suffix), those whose labels include ``labels``, keyed by their labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in (name, f"{name}_total") and labels.items() <= s.labels.items():
                    out[tuple(sorted(s.labels.items()))] = s.value
        return out

    def per_worker(self, name: str, pool: str) -> dict[str, float]:
        """A per-worker metric of ``pool``, by worker id."""
        return {dict(k)["worker"]: v for k, v in self.metric(name, pool=pool).items()}

    def wait_for(
        self, what: str, ok: Callable[[], T], timeout: float = 60, every: float = 0.5
    ) -> T:
        """``ok()`` once it is truthy (exceptions count as not yet), else fail after
        ``timeout`` seconds with ``what``."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                last = ok()
                if last:
                    return last
            except Exception as e:  # noqa: BLE001 - not ready yet
                last = e
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}: {last!r}")
