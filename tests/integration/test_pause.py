"""vLLM's /pause, /resume and /is_paused on a deployment of two workers (reference engine),
through real HTTP and the official client: each mode's effect on the streams in flight, the
requests that come while paused, the prefix cache cleared, a pause longer than the API's
frame timeouts, and workers that follow the pause from its Redis key alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from cluster.keys import PAUSED_KEY
from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    base_env,
    generate_workers,
    wait_for,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 2.0  # the API's first-frame and frame timeouts here: a pause outlasts them


@pytest.fixture(scope="module")
def deployment(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    env = base_env(redis_dbs.take(__name__), tiny_model_dir,
                   CONVEYOR_FIRST_FRAME_TIMEOUT_S=str(TIMEOUT_S),
                   CONVEYOR_FRAME_TIMEOUT_S=str(TIMEOUT_S))  # fmt: skip
    with generate_workers("pause", env, tiny_model_dir, tmp_path_factory.mktemp("pause"),
                          ["pause-w0", "pause-w1"]) as c:  # fmt: skip
        yield c


@pytest.fixture
def c(deployment: Cluster) -> Iterator[Cluster]:
    yield deployment
    httpx.post(f"{deployment.url}/resume", timeout=60)  # whatever a test left


class Stream:
    """One greedy streamed completion on a thread: its text, finish and token count."""

    def __init__(self, c: Cluster, prompt: str, max_tokens: int) -> None:
        self.text, self.finish, self.tokens = "", None, 0
        self.ended_at: float | None = None
        self.error: Exception | None = None
        self._args = (c, prompt, max_tokens)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        c, prompt, max_tokens = self._args
        try:
            for chunk in c.client(max_retries=0, timeout=120).completions.create(
                model=c.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            ):  # fmt: skip
                ch = chunk.choices[0]
                self.text += ch.text
                self.tokens += 1 if ch.text else 0
                self.finish = ch.finish_reason or self.finish
        except Exception as e:  # noqa: BLE001 - asserted on
            self.error = e
        self.ended_at = time.monotonic()

    def wait_text(self, chars: int) -> None:
        wait_for(lambda: len(self.text) >= chars or self.ended_at is not None, 30, "tokens")

    def join(self, timeout: float = 60) -> None:
        self._t.join(timeout)
        assert self.ended_at is not None, "the stream did not end"
        assert self.error is None, self.error


def complete(c: Cluster, prompt: str, max_tokens: int) -> tuple[str, str | None, int]:
    r = c.client(timeout=120).completions.create(model=c.model_name, prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
    cached = (r.usage.prompt_tokens_details.cached_tokens or 0
              if r.usage and r.usage.prompt_tokens_details else 0)  # fmt: skip
    return r.choices[0].text, r.choices[0].finish_reason, cached


def pause(c: Cluster, **params: object) -> dict:
    r = httpx.post(f"{c.url}/pause", params=params, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def is_paused(c: Cluster) -> bool:
    return httpx.get(f"{c.url}/is_paused", timeout=10).json()["is_paused"]


def later(fn, *args) -> tuple[threading.Thread, list]:  # type: ignore[no-untyped-def]
    """``fn(*args)`` on a thread; its result lands in the list."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_keep_freezes_streams_and_holds_new_requests_past_the_frame_timeouts(c: Cluster) -> None:
    prompt, new_prompt = "Pause keep: the stream in flight", "A request sent while paused"
    expected = complete(c, prompt, 400)[0]
    expected_new = complete(c, new_prompt, 12)[0]
    s = Stream(c, prompt, 400)
    s.wait_text(20)
    body = pause(c, mode="keep")
    assert body["status"] == "paused" and sorted(body["workers"]) == ["pause-w0", "pause-w1"]
    assert all(w["success"] and w["paused"] for w in body["workers"].values())
    assert is_paused(c) is True
    time.sleep(0.3)  # frames published before the pause arrive
    frozen = len(s.text)
    t, out = later(complete, c, new_prompt, 12)
    time.sleep(TIMEOUT_S * 2)  # past the API's frame timeouts: nothing moves, nothing fails
    assert len(s.text) == frozen and s.ended_at is None
    assert t.is_alive() and not out
    r = httpx.post(f"{c.url}/resume", timeout=60).json()
    assert r["status"] == "resumed"
    assert sum(w["released"] for w in r["workers"].values()) == 1  # the new request
    assert is_paused(c) is False
    s.join()
    t.join(60)
    assert s.error is None and s.finish == "length" and s.text == expected
    assert out and out[0][0] == expected_new and out[0][1] == "length"


def test_abort_ends_streams_in_flight_and_clears_the_prefix_cache(c: Cluster) -> None:
    cached_prompt = "A prompt long enough to fill a few KV blocks, " * 4
    complete(c, cached_prompt, 4)
    assert complete(c, cached_prompt, 4)[2] > 0  # cached the second time
    s = Stream(c, "Pause abort: the stream in flight", 1500)
    s.wait_text(20)
    body = pause(c)  # mode abort, clear_cache: vLLM's defaults
    assert body["status"] == "paused"
    s.join()
    assert s.finish == "abort" and 20 <= len(s.text) and s.tokens < 1500
    t, out = later(complete, c, cached_prompt, 4)
    time.sleep(1.0)
    assert t.is_alive()  # held until the resume
    httpx.post(f"{c.url}/resume", timeout=60)
    t.join(60)
    assert out and out[0][1] == "length"
    assert out[0][2] == 0  # the pause forgot every cached block (new weights, new KV)


def test_wait_answers_once_the_streams_in_flight_have_ended(c: Cluster) -> None:
    prompt = "Pause wait: the stream in flight"
    expected = complete(c, prompt, 300)[0]
    s = Stream(c, prompt, 300)
    s.wait_text(10)
    body = pause(c, mode="wait", clear_cache="false")
    answered = time.monotonic()
    assert body["status"] == "paused"
    s.join()
    assert s.finish == "length" and s.text == expected
    assert s.ended_at is not None and s.ended_at <= answered + 0.5  # ended before the answer
    httpx.post(f"{c.url}/resume", timeout=60)


def test_workers_follow_the_pause_key_without_the_command(c: Cluster) -> None:
    """A worker that missed the command (or started while paused) reads the key: here the
    key is set and deleted straight in Redis, with no command sent."""
    r = redis.Redis.from_url(c.redis_url)
    r.set(PAUSED_KEY, '{"mode": "keep"}')
    time.sleep(6)  # every worker reads it within 5 s
    t, out = later(complete, c, "Held by the key alone", 8)
    time.sleep(1.5)
    assert t.is_alive() and not out
    r.delete(PAUSED_KEY)
    t.join(30)
    assert out and out[0][1] == "length"


def test_bad_mode_is_a_400_naming_it(c: Cluster) -> None:
    r = httpx.post(f"{c.url}/pause", params={"mode": "later"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "mode"
    assert is_paused(c) is False
