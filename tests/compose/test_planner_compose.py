"""The planner's compose connector against the real Docker daemon: the generate worker
service scaled 1 -> 2 -> 1 through the Docker Engine API (no compose CLI). The clone joins
the pool and serves; scaled down, it drains the stream it holds (SIGTERM: warm shutdown),
leaves the pool and is removed."""

from __future__ import annotations

import pytest

from planner.connectors import ComposeConnector, Decision
from tests.compose.stack import Stack

pytestmark = pytest.mark.integration

GEN = "worker-generate"


def _live(stack: Stack) -> set[str]:
    """The generate pool's live worker ids (the API's per-worker metrics)."""
    return set(stack.per_worker("conveyor_worker_frames_published", "generate"))


def test_the_compose_connector_scales_the_worker_service(stack: Stack, model: str) -> None:
    stack.up(scale={GEN: 1})
    first = stack.wait_for(
        "1 live generate worker", lambda: len(_live(stack)) == 1 and _live(stack)
    )
    connector = ComposeConnector({"generate": GEN}, project=stack.project)
    assert connector.replicas("generate") == 1

    up = Decision(pool="generate", replicas=2, previous=1, reason="compose test")
    connector.scale(up)
    assert connector.replicas("generate") == 2
    joined = stack.wait_for(
        "the clone joins the generate pool", lambda: _live(stack) - first, timeout=180
    )
    (clone_worker,) = joined
    clone = stack.container_of_worker(clone_worker)
    labels = clone["Config"]["Labels"]
    number = int(labels["com.docker.compose.container-number"])
    assert clone["Name"] == f"/{stack.project}-{GEN}-{number}" and number >= 2
    assert labels["com.docker.compose.service"] == GEN
    assert connector.settled(up)

    c = stack.client(timeout=180)
    moved = sum(stack.metric("conveyor_migrations", pool="generate", outcome="moved").values())
    stream = c.completions.create(
        model=model,
        prompt="A story told by the new worker:",
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-conveyor-worker-id": clone_worker},
    )
    down = Decision(pool="generate", replicas=1, previous=2, reason="compose test")
    usage, reason = None, None
    for i, chunk in enumerate(stream):
        if i == 5:  # the clone streams: scale it away (the newest), it must drain
            connector.scale(down)
            assert connector.replicas("generate") == 1  # a draining worker is not counted
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
        usage = chunk.usage or usage
    assert reason == "length" and usage is not None and usage.completion_tokens == 200
    after = sum(stack.metric("conveyor_migrations", pool="generate", outcome="moved").values())
    assert after == moved, "the stream was moved, not drained on its worker"

    connector.wait_idle(300)
    assert connector.settled(down)
    stack.wait_for("the clone leaves the pool", lambda: _live(stack) == first, timeout=60)
    left = [w["Id"] for w in stack.containers(GEN, all_=True)]
    assert left and clone["Id"] not in left, "the drained clone was not removed"
    out = c.completions.create(
        model=model, prompt="after the scale-down", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 8
