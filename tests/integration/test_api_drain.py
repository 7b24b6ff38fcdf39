"""An API process's graceful shutdown (api.drain), over real HTTP: on SIGTERM it takes no
new connection, its streams in flight run to their end, and one still open when the drain
is over ends with an error event, never cut off; the process then exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def deployment(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    """One mock worker at ~5 ms a decode step (a 400-token stream lasts ~2 s)."""
    logdir = tmp_path_factory.mktemp("drain")
    env = base_env(redis_dbs.take(__name__), tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="1")  # fmt: skip
    worker = start_worker("drain-w", "generate", "drain-w0", env, logdir)
    yield {"env": env, "logdir": logdir, "worker": worker, "model": tiny_model_dir.name}
    worker.stop()


class Events:
    """One streamed completion's SSE data lines, read on a thread."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.data: list[str] = []
        self.error: Exception | None = None
        body = {"model": model, "prompt": "Drain me", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        self._t = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._t.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line[6:])
        except Exception as e:  # noqa: BLE001 - asserted on
            self.error = e

    def join(self) -> None:
        self._t.join(60)
        assert not self._t.is_alive() and self.error is None, self.error

    def chunks(self) -> list[dict]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]


def _api(deployment: dict, name: str, drain_s: str):  # type: ignore[no-untyped-def]
    env = {**deployment["env"], "CONVEYOR_SHUTDOWN_DRAIN_S": drain_s}
    api, url = start_api(name, env, deployment["logdir"])
    with stop_on_error(api):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "the worker",
                 [api, deployment["worker"]])  # fmt: skip
    return api, url


def test_sigterm_lets_streams_in_flight_end_and_refuses_new_connections(deployment: dict) -> None:
    api, url = _api(deployment, "api-drain-long", "20")
    try:
        s = Events(url, deployment["model"], 400)
        wait_for(lambda: len(s.data) >= 10, 30, "the stream under way")
        sent = time.monotonic()
        api.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # the socket is closed: fail over elsewhere
            httpx.get(f"{url}/health", timeout=2)
        s.join()
        chunks = s.chunks()
        assert s.data[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 400
        # it exits once its streams are done, not at the drain's end (by the signal: uvicorn
        # raises it again once it has shut down)
        assert api.popen.wait(15) in (0, -signal.SIGTERM)
        assert time.monotonic() - sent < 15
        assert "draining (up to 20 s)" in api.log.read_text()
    finally:
        api.stop()


def test_a_stream_still_open_when_the_drain_is_over_ends_with_an_error_event(
    deployment: dict,
) -> None:
    api, url = _api(deployment, "api-drain-short", "1")
    try:
        s = Events(url, deployment["model"], 1500)  # ~8 s of tokens
        wait_for(lambda: len(s.data) >= 10, 30, "the stream under way")
        sent = time.monotonic()
        api.popen.send_signal(signal.SIGTERM)
        s.join()
        assert time.monotonic() - sent < 6
        # a stream that fails ends with its error event, then [DONE] (as vLLM's)
        assert s.data[-1] == "[DONE]", s.data[-3:]
        last = json.loads(s.data[-2])
        assert last["error"]["code"] == "server_shutting_down", last
        assert len(s.chunks()) > 10  # after the tokens it had
        assert api.popen.wait(15) in (0, -signal.SIGTERM)
    finally:
        api.stop()
