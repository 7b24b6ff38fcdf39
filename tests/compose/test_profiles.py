"""The `disagg` and `encode` profiles: the same greedy output as the aggregated stack for
short and long text prompts and an image, and each profile's pools really used (KV pulled
by the decode workers; the image encoded by the encode pool)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from tests.compose.stack import Stack

pytestmark = pytest.mark.integration

# Prompts past CONVEYOR_DISAGG_MIN_PROMPT_TOKENS (256) go prefill -> decode; shorter ones
# run aggregated on a decode worker. The default model's tokenizer: ~1 token per 2 chars.
SHORT = ["The capital of France is", "def fibonacci(n):", "Three things to pack:"]
LONG = [
    "Summarise this log. " + " ".join(f"line {i}: request served in {i * 3} ms" for i in range(30)),
    "Continue the list: " + ", ".join(f"item number {i}" for i in range(60)),
]


def _image_url() -> str:
    """A small PNG as a data: URL (the default model's tower takes 32x32)."""
    img = Image.new("RGB", (48, 40))
    img.putdata([(x * 5 % 256, y * 7 % 256, x * y % 256) for y in range(40) for x in range(48)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": _image_url()}},
        ],
    }
]


Outputs = dict[str, tuple[str, int, int]]


def _outputs(stack: Stack, model: str) -> Outputs:
    """Greedy (text, prompt tokens, completion tokens) for every prompt, one at a time."""
    c = stack.client()
    out = {}
    for p in SHORT + LONG:
        r = c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
        out[p] = (r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens)
    r = c.chat.completions.create(model=model, messages=IMAGE_CHAT, max_tokens=24, temperature=0)
    out["image"] = (r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens)
    return out


@pytest.fixture(scope="module")
def agg(stack: Stack, model: str) -> Outputs:
    stack.up()
    ref = _outputs(stack, model)
    assert all(ref[p][1] > 256 for p in LONG), "the long prompts must pass the disagg threshold"
    return ref


def _total(stack: Stack, name: str, pool: str) -> float:
    return sum(stack.per_worker(name, pool).values())


def _kv_pulls(stack: Stack) -> float:
    """KV pulls by every worker (the metric is per worker and backend, not per pool)."""
    return sum(stack.metric("conveyor_kv_transfers").values())


# mode, profiles, replicas, the live workers /health then reports
PROFILES = [
    ("disagg", ["disagg"], {"worker-generate": 0}, {"prefill": 1, "decode": 1}),
    ("e-pd", ["encode"], {"worker-generate": 1}, {"encode": 1, "generate": 1}),
    (
        "e-p-d",
        ["encode", "disagg"],
        {"worker-generate": 0},
        {"encode": 1, "prefill": 1, "decode": 1},
    ),
]


@pytest.mark.parametrize(
    ("mode", "profiles", "scale", "pools"), PROFILES, ids=[m[0] for m in PROFILES]
)
def test_profile_gives_the_aggregated_output(
    stack: Stack,
    model: str,
    agg: Outputs,
    mode: str,
    profiles: list[str],
    scale: dict[str, int],
    pools: dict[str, int],
) -> None:
    stack.up(mode, profiles, scale)
    assert not stack.containers("worker-generate") or scale["worker-generate"]
    stack.wait_for(f"live workers {pools}", lambda: stack.health().json()["workers"] == pools)
    pulled = _kv_pulls(stack)
    encoded = {pool: _total(stack, "conveyor_images_encoded", pool) for pool in pools}
    assert _outputs(stack, model) == agg
    if "prefill" in pools:
        stack.wait_for(  # heartbeats carry the counts (every 2 s)
            "the decode worker pulling the long prompts' KV from the prefill worker",
            lambda: _kv_pulls(stack) >= pulled + len(LONG),
            timeout=15,
        )
    if "encode" in pools:
        stack.wait_for(
            "the image encoded by the encode pool",
            lambda: _total(stack, "conveyor_images_encoded", "encode") == encoded["encode"] + 1,
            timeout=15,
        )
        for pool in pools:
            if pool != "encode":
                got = _total(stack, "conveyor_images_encoded", pool)
                assert got == encoded[pool], f"the {pool} pool encoded the image too"
