"""The default deployment (CONVEYOR_MODE=agg: redis, api, flower, generate workers):
healthy in time, served through the published port, scaled, a worker killed mid-stream,
Redis restarted under load."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.compose.stack import HEALTHY_WITHIN_S, Stack

pytestmark = pytest.mark.integration

GEN = "worker-generate"


def test_the_stack_comes_up_healthy(stack: Stack) -> None:
    took = stack.up()
    print(f"compose: every service healthy {took:.0f} s after `up`")
    assert took <= HEALTHY_WITHIN_S
    running = stack.containers()
    services = sorted(c["Config"]["Labels"]["com.docker.compose.service"] for c in running)
    assert services == ["api", "flower", "redis", GEN], services
    for c in running:
        assert c["State"]["Health"]["Status"] == "healthy", c["Name"]


def test_containers_talk_only_over_the_project_network(stack: Stack) -> None:
    """Each container is on the project's own network and nothing else; only the API and
    Flower publish a port, on 127.0.0.1."""
    for c in stack.containers():
        name = c["Name"]
        assert list(c["NetworkSettings"]["Networks"]) == [f"{stack.project}_default"], name
        published = {
            port: [b["HostIp"] for b in binds]
            for port, binds in (c["HostConfig"]["PortBindings"] or {}).items()
        }
        service = c["Config"]["Labels"]["com.docker.compose.service"]
        want = {"api": {"8000/tcp": ["127.0.0.1"]}, "flower": {"5555/tcp": ["127.0.0.1"]}}
        assert published == want.get(service, {}), (name, published)


def test_the_worker_runs_the_kernel_built_with_the_image(stack: Stack) -> None:
    """The image has no compiler; the worker loads the decode kernel compiled at build time."""
    probe = (
        "import shutil; from tasks.settings import Settings; from workers import paged_kernel; "
        "paged_kernel.load(Settings().engine.kernel_path()); "
        "assert not shutil.which('gcc') and not shutil.which('cc'), 'a compiler in the image'"
    )
    r = stack.compose("exec", "-T", GEN, "python", "-c", probe, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    logs = stack.compose("logs", GEN).stdout
    assert "decode attention: kernel" in logs, logs[-2000:]


def test_the_openai_client_through_the_published_port(stack: Stack, model: str) -> None:
    c = stack.client()
    assert [m.id for m in c.models.list().data] == [model]
    chat = dict(model=model, messages=[{"role": "user", "content": "Hello there"}])
    one = c.chat.completions.create(**chat, max_tokens=12, temperature=0)
    two = c.chat.completions.create(**chat, max_tokens=12, temperature=0)
    assert one.choices[0].finish_reason in ("length", "stop")
    assert one.choices[0].message.content == two.choices[0].message.content  # greedy
    assert one.usage.completion_tokens <= 12 and one.usage.prompt_tokens > 0
    # streamed: the same greedy text, usage on the last chunk
    chunks = list(
        c.chat.completions.create(
            **chat,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == one.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == one.usage.completion_tokens
    # completions, max_tokens honoured exactly with ignore_eos
    out = c.completions.create(
        model=model, prompt="Once upon a time", max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
    # errors in OpenAI's shape, with the status that fits
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)
    raw = c.completions.with_raw_response.create(model=model, prompt="x", max_tokens=2)
    assert raw.headers.get("x-request-id")


def test_flower_asks_for_its_login(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.flower_port}/broker"
    assert httpx.get(url, timeout=10).status_code == 401
    user, _, password = stack.dotenv["FLOWER_BASIC_AUTH"].partition(":")
    assert httpx.get(url, auth=(user, "wrong"), timeout=10).status_code == 401
    page = httpx.get(url, auth=(user, password), timeout=30)
    assert page.status_code == 200 and "generate" in page.text  # the stage queues


def _frames(stack: Stack) -> dict[str, float]:
    return stack.per_worker("conveyor_worker_frames_published", "generate")


def test_three_workers_share_the_requests(stack: Stack, model: str) -> None:
    stack.up(scale={GEN: 3})
    assert len(stack.containers(GEN)) == 3
    stack.wait_for("3 live generate workers", lambda: len(_frames(stack)) == 3)
    before = _frames(stack)
    c = stack.client()

    def one(i: int) -> int:
        out = c.completions.create(
            model=model,
            prompt=f"Request {i}: tell me about {i * 7}",
            max_tokens=48,
            extra_body={"ignore_eos": True},
        )
        return out.usage.completion_tokens

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(24))) == [48] * 24

    def spread() -> dict[str, float] | None:  # heartbeats carry the counts (every 2 s)
        d = {w: n - before.get(w, 0) for w, n in _frames(stack).items()}
        return d if len(d) == 3 and all(v > 0 for v in d.values()) else None

    served = stack.wait_for("frames from each of the 3 workers", spread, timeout=15)
    print(f"compose: frames published per worker for 24 requests: {sorted(served.values())}")


def test_a_worker_killed_mid_stream(stack: Stack, model: str) -> None:
    """`docker kill` of the container streaming a request: the stream completes on another
    worker (migration), and later requests are served."""
    stack.up(scale={GEN: 3})
    stack.wait_for("3 live generate workers", lambda: len(_frames(stack)) == 3)
    victim = sorted(_frames(stack))[0]
    container = stack.container_of_worker(victim)
    moved = sum(stack.metric("conveyor_migrations", pool="generate", outcome="moved").values())
    c = stack.client(timeout=120)
    stream = c.completions.create(
        model=model,
        prompt="A long story:",
        max_tokens=1900,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-conveyor-worker-id": victim},
    )
    text, usage, reason = [], None, None
    for i, chunk in enumerate(stream):
        if i == 10:  # streaming from the victim: kill its container
            subprocess.run(["docker", "kill", container["Id"]], check=True, capture_output=True)
        for ch in chunk.choices:
            text.append(ch.text)
            reason = ch.finish_reason or reason
        usage = chunk.usage or usage
    assert reason == "length" and usage is not None and usage.completion_tokens == 1900
    after = sum(stack.metric("conveyor_migrations", pool="generate", outcome="moved").values())
    assert after == moved + 1, "the stream was not moved to another worker"
    assert not stack.containers(GEN) or all(
        w["Id"] != container["Id"] for w in stack.containers(GEN)
    ), "the killed worker still runs"
    for i in range(6):
        out = c.completions.create(
            model=model, prompt=f"after the kill {i}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 8


def _starts(stack: Stack) -> dict[str, tuple[int, str]]:
    """Restart count and start time of every API and worker container."""
    return {
        c["Name"]: (c["RestartCount"], c["State"]["StartedAt"])
        for c in stack.containers()
        if c["Config"]["Labels"]["com.docker.compose.service"] != "redis"
    }


def test_a_redis_restart_with_streams_in_flight(stack: Stack, model: str) -> None:
    """`docker compose restart redis` while 4 streams run: each ends cleanly (whole, or an
    error event saying why), never hangs; once a request succeeds again, no request fails
    (no 5xx); no API or worker container restarted; what Redis held is still there (its
    append-only file)."""
    stack.up(scale={GEN: 2})
    stack.wait_for("2 live generate workers", lambda: len(_frames(stack)) == 2)
    starts = _starts(stack)
    probe = ["exec", "-T", "redis", "redis-cli"]
    assert stack.compose(*probe, "SET", "conveyor-ci:probe", "kept").stdout.strip() == "OK"
    c = stack.client(timeout=120)
    outcomes: list[tuple[str | None, str | None]] = []
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        reason, err = None, None
        try:
            s = c.completions.create(
                model=model,
                prompt=f"In flight {i}",
                max_tokens=1900,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for n, chunk in enumerate(s):
                if n == 0:
                    started.wait(30)
                reason = next((x.finish_reason for x in chunk.choices if x.finish_reason), reason)
        except openai.APIError as e:
            err = f"{type(e).__name__}: {e}"
        finally:
            outcomes.append((reason, err))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    stack.compose("restart", "redis", timeout=120)
    back = time.monotonic()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hangs after the Redis restart"
    for reason, err in outcomes:
        assert err is not None or reason == "length", (reason, err)
    stack.wait_for("/health 200 after the restart", lambda: stack.health().status_code == 200)
    ok, recovered = 0, None
    deadline = back + 60
    while ok < 20 and time.monotonic() < deadline:
        try:
            out = c.completions.create(
                model=model, prompt=f"after {ok}", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 4
            recovered = recovered or time.monotonic() - back
            ok += 1
        except openai.APIError as e:
            assert ok == 0, f"a request failed once Redis was back and serving: {e}"
            time.sleep(0.5)
    assert ok == 20, f"only {ok} requests succeeded within 60 s of Redis's restart"
    print(
        f"compose: Redis restart: first request served {recovered:.1f} s after it; "
        f"streams in flight: {outcomes}"
    )
    assert _starts(stack) == starts, "an API or worker container restarted"
    assert stack.compose(*probe, "GET", "conveyor-ci:probe").stdout.strip() == "kept"
