"""``conveyor serve`` keeps to its own ports and its own Redis (real processes): a taken port
is a one-line error before anything starts; the embedded Redis requires a password and is
the process serve started; two deployments on different ports run side by side and share
no key."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import httpx
import pytest
import redis

from tasks.settings import Settings
from tests.integration.conftest import BIN, free_port, spawn, wait_for
from tests.integration.test_serve import _alive, _descendants

pytestmark = pytest.mark.integration


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP="20", CONVEYOR_HEARTBEAT_S="0.5",
               CONVEYOR_SERVE_STATE_DIR=str(tmp / "state"), **extra)  # fmt: skip
    return env


def _serve(tmp: Path, model: Path, name: str, api: int, flower: int, rport: int):  # type: ignore[no-untyped-def]
    argv = [str(BIN / "conveyor"), "serve", "--model", str(model), "--port", str(api),
            "--flower-port", str(flower), "--redis-port", str(rport), "--workers", "1"]  # fmt: skip
    return spawn(name, argv, _env(tmp), tmp)


@pytest.mark.parametrize("which", ["api", "flower", "redis"])
def test_a_taken_port_stops_serve_before_anything_starts(
    tiny_model_dir: Path, tmp_path: Path, which: str
) -> None:
    ports = {"api": free_port(), "flower": free_port(), "redis": free_port()}
    setting = {"api": "--port", "flower": "--flower-port", "redis": "--redis-port"}[which]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports[which]))
        squatter.listen()
        serve = _serve(tmp_path, tiny_model_dir, f"serve-{which}", ports["api"],
                       ports["flower"], ports["redis"])  # fmt: skip
        assert serve.popen.wait(30) == 1
        kids = _descendants(serve.popen.pid)
    log = serve.log.read_text()
    assert f"port {ports[which]}" in log and setting in log, log
    assert "started" not in log, log  # nothing was started
    assert not [k for k in kids if _alive(k)]


def test_two_deployments_side_by_side_with_their_own_password_protected_redis(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    deployments = []
    try:
        for i in range(2):
            d = tmp_path / f"d{i}"
            d.mkdir()
            ports = (free_port(), free_port(), free_port())
            deployments.append((d, ports, _serve(d, tiny_model_dir, f"serve{i}", *ports)))
        for d, (api, _, rport), serve in deployments:
            url = f"http://127.0.0.1:{api}"
            wait_for(lambda u=url: httpx.get(f"{u}/health", timeout=1).status_code == 200, 120,
                     "serve healthy", [serve])  # fmt: skip
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": tiny_model_dir.name, "prompt": f"hi {api}",
                                 "max_tokens": 3})  # fmt: skip
            assert r.status_code == 200, r.text
            # the embedded Redis wants its password; the tools on this host find it
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=rport).ping()
            s = Settings(redis_port=rport, serve_state_dir=d / "state")
            assert redis.Redis.from_url(s.effective_redis_url).ping()
            assert oct(s.redis_password_file.stat().st_mode & 0o777) == "0o600"
        # no key is shared: each Redis holds only its own workers and streams
        keysets = []
        for d, (_, _, rport), _ in deployments:
            s = Settings(redis_port=rport, serve_state_dir=d / "state")
            keysets.append({k for k in redis.Redis.from_url(s.effective_redis_url).keys("*")
                            if k.startswith(b"conveyor:worker:")})  # fmt: skip
        assert all(keysets) and not (keysets[0] & keysets[1])
    finally:
        for _, _, serve in deployments:
            if serve.popen.poll() is None:
                serve.popen.send_signal(signal.SIGINT)
        for _, _, serve in deployments:
            try:
                serve.popen.wait(60)
            except Exception:  # noqa: BLE001
                serve.stop(signal.SIGKILL)
