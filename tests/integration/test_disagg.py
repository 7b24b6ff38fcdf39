"""Disaggregated prefill/decode through the real pipeline: prefill and decode in separate
``conveyor worker`` processes, the KV moved by each backend (NIXL, Redis), compared with the
aggregated deployment token for token; fallbacks, failures and block accounting."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.keys import worker_key
from tests.integration.conftest import (
    Cluster,
    Proc,
    RedisDbs,
    base_env,
    celery_at,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

MAX_LEN = 2048
_rng = random.Random(2026)
# 31 prompts: 1 token to near the context limit, crossing 16-token block boundaries
LENGTHS = [
    1,
    2,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    300,
    400,
    511,
    512,
    513,
    700,
    1000,
    1023,
    1024,
    1500,
    2000,
    2040,
]
PROMPTS = [[1] + [_rng.randrange(5, 512) for _ in range(n - 1)] for n in LENGTHS]
OUT = [min(6 + i % 19, MAX_LEN - len(p)) for i, p in enumerate(PROMPTS)]


@dataclass
class Disagg:
    url: str
    redis_url: str
    prefill: Proc
    decode: Proc
    api: Proc
    model: str

    def loads(self) -> dict[str, dict]:
        r = redis.Redis.from_url(self.redis_url)
        out = {}
        for pool in ("prefill", "decode"):
            for key in r.scan_iter(worker_key(pool, "*")):
                raw = r.get(key)
                if raw:
                    info = json.loads(raw)
                    out[info["worker_id"]] = info
        return out

    def idle(self) -> bool:
        ls = self.loads()
        return len(ls) == 2 and all(
            w["blocks_used"] == 0 and w["blocks_pinned"] == 0 for w in ls.values()
        )


def _start_disagg(
    name: str, redis_url: str, model_dir: Path, logdir: Path, backend: str, **env_extra: str
) -> Disagg:
    env = base_env(
        redis_url,
        model_dir,
        CONVEYOR_MODE="disagg",
        CONVEYOR_KV_TRANSFER=backend,
        CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0",
        CONVEYOR_KV_PIN_TIMEOUT_S="3",
        **env_extra,
    )
    pre = start_worker(f"{name}-prefill", "prefill", f"{name}-p", env, logdir)
    dec = start_worker(f"{name}-decode", "decode", f"{name}-d", env, logdir)
    with stop_on_error(pre, dec):
        api, url = start_api(f"{name}-api", env, logdir)
    d = Disagg(url, redis_url, pre, dec, api, model_dir.name)
    with stop_on_error(pre, dec, api):
        wait_for(
            lambda: httpx.get(f"{url}/health").json()["workers"] == {"prefill": 1, "decode": 1},
            90,
            f"{name} workers",
            [pre, dec, api],
        )
    return d


@pytest.fixture(scope="module", params=["redis", "nixl"])
def disagg(
    request: pytest.FixtureRequest,
    redis_dbs: RedisDbs,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Disagg]:
    backend = request.param
    if backend == "nixl":
        pytest.importorskip("nixl._api", reason="nixl not installed: NIXL path not tested")
    url = redis_dbs.take(f"{__name__}[{backend}]")
    d = _start_disagg(
        f"dis-{backend}", url, tiny_model_dir, tmp_path_factory.mktemp(backend), backend
    )
    yield d
    for p in (d.api, d.prefill, d.decode):
        p.stop()


async def _complete_all(url: str, model: str, prompts: list[list[int]], outs: list[int]) -> list:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(4)

    async def one(p: list[int], n: int) -> tuple[str, int]:
        async with sem:
            r = await client.completions.create(
                model=model, prompt=p, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text, r.usage.completion_tokens

    return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs, strict=True)))


@pytest.fixture(scope="module")
def agg_reference(cluster: Cluster) -> list:
    return asyncio.run(_complete_all(cluster.url, cluster.model_name, PROMPTS, OUT))


# ----------------------------------------------------------------------------------------


def test_disagg_equals_agg_for_31_prompts(disagg: Disagg, agg_reference: list) -> None:
    got = asyncio.run(_complete_all(disagg.url, disagg.model, PROMPTS, OUT))
    bad = [(len(p), g, w) for p, g, w in zip(PROMPTS, got, agg_reference, strict=True) if g != w]
    assert not bad, f"{len(bad)} prompts differ from agg, e.g. {bad[0]}"
    assert [c for _, c in got] == OUT
    wait_for(disagg.idle, 10, "blocks back to zero on both workers")
    dec = f"{disagg.decode.name.removesuffix('-decode')}-d"

    def pulled() -> dict:
        return disagg.loads()[dec]["kv_transfer"]

    # every prompt went through prefill -> KV pull -> decode (heartbeats lag a little)
    wait_for(lambda: pulled()["count"] >= len(PROMPTS), 5, "transfer counters")
    assert pulled()["bytes"] > 0
    backend = disagg.prefill.name.split("-")[1]
    lab = f'{{backend="{backend}",worker="{dec}"}}'
    assert _metric(disagg.url, f"conveyor_kv_transfers_total{lab}") >= len(PROMPTS)
    assert _metric(disagg.url, f"conveyor_kv_transfer_bytes_total{lab}") == pulled()["bytes"]
    assert _metric(disagg.url, f"conveyor_kv_transfer_seconds_total{lab}") > 0
    assert _metric(disagg.url, 'conveyor_queue_depth{queue="prefill"}') == 0
    assert _metric(disagg.url, f'conveyor_queue_depth{{queue="decode.{dec}"}}') == 0
    assert _metric(disagg.url, 'conveyor_workers_live{pool="prefill"}') == 1


def test_streamed_disagg_matches_and_frames_continue(disagg: Disagg, agg_reference: list) -> None:
    """The first token comes from the prefill worker (frame 0), the rest from the decode
    worker (frames 1..): the client sees one seamless stream."""
    c = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="x")
    i = 20  # a 400-token prompt
    chunks = list(
        c.completions.create(
            model=disagg.model,
            prompt=PROMPTS[i],
            max_tokens=OUT[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == agg_reference[i][0]
    assert chunks[-1].usage.completion_tokens == OUT[i]


def test_disagg_logprobs_equal_agg(disagg: Disagg, cluster: Cluster) -> None:
    """The prefill worker's first frame carries the first token's logprobs and the prompt's;
    the decode worker's frames the next tokens': the same numbers as the aggregated run,
    streamed or not."""
    dis = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="x", max_retries=0)
    agg = cluster.client(max_retries=0)
    for i in (2, 11, 20):  # 15-, 100- and 400-token prompts
        kw: dict = dict(prompt=PROMPTS[i], max_tokens=8, temperature=0, logprobs=3,
                        extra_body={"ignore_eos": True, "prompt_logprobs": 2})  # fmt: skip
        want = agg.completions.create(model=cluster.model_name, **kw).choices[0]
        got = dis.completions.create(model=disagg.model, **kw).choices[0]
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-3)
        assert [list(t) for t in got.logprobs.top_logprobs] == [
            list(t) for t in want.logprobs.top_logprobs
        ]
        mine, ref = got.model_extra["prompt_logprobs"], want.model_extra["prompt_logprobs"]
        assert len(mine) == len(PROMPTS[i]) and mine[0] is None and ref[0] is None
        for a, b in zip(mine[1:], ref[1:], strict=True):
            assert list(a) == list(b)
            assert [v["logprob"] for v in a.values()] == pytest.approx(
                [v["logprob"] for v in b.values()], abs=1e-3
            )
        chunks = list(dis.completions.create(model=disagg.model, stream=True, **kw))
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.tokens]  # fmt: skip
        assert streamed == want.logprobs.tokens  # the first one (the prefill's) included


def test_disagg_token_ids_equal_agg(disagg: Disagg, cluster: Cluster) -> None:
    """return_token_ids: the prefill worker's first token, then the decode worker's, the
    aggregated run's ids, streamed or not."""
    dis = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="x", max_retries=0)
    kw: dict = dict(prompt=PROMPTS[11], max_tokens=8, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    want = cluster.client(max_retries=0).completions.create(model=cluster.model_name, **kw)
    ids = want.choices[0].model_extra["token_ids"]
    assert len(ids) == 8
    got = dis.completions.create(model=disagg.model, **kw).choices[0].model_extra
    assert (got["token_ids"], got["prompt_token_ids"]) == (ids, PROMPTS[11])
    chunks = list(dis.completions.create(model=disagg.model, stream=True, **kw))
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids")
            or []] == ids  # fmt: skip


def test_disagg_beam_search_and_cache_salt_equal_agg_and_reset_reaches_both_pools(
    disagg: Disagg, cluster: Cluster
) -> None:
    """Beam search's one-token steps (each prefilled on a prefill worker, its logprobs on
    the first frame) find the aggregated run's beams, salted or not; the prefix-cache
    reset reaches the prefill and the decode workers."""
    dis = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="x", max_retries=0)
    agg = cluster.client(max_retries=0)
    for salt in (None, "tenant-a"):
        extra = {"use_beam_search": True, **({"cache_salt": salt} if salt else {})}
        kw: dict = dict(prompt=PROMPTS[11], max_tokens=4, n=3, extra_body=extra)
        want = [c.text for c in agg.completions.create(model=cluster.model_name, **kw).choices]
        got = [c.text for c in dis.completions.create(model=disagg.model, **kw).choices]
        assert got == want and len(set(got)) == 3

    def reset() -> dict:
        return httpx.post(f"{disagg.url}/reset_prefix_cache", timeout=60).json()

    wait_for(lambda: reset()["success"], 20, "an idle prefix-cache reset")  # no KV pinned
    assert {w["pool"] for w in reset()["workers"].values()} == {"prefill", "decode"}


def test_cancel_mid_decode_frees_both_sides(disagg: Disagg) -> None:
    wait_for(disagg.idle, 10, "idle")
    body = {
        "model": disagg.model,
        "prompt": PROMPTS[25],
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{disagg.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        data = 0
        while data < 10:
            data += next(lines).startswith("data:")
        wait_for(
            lambda: disagg.loads()[f"{disagg.decode.name[:-7]}-d"]["blocks_used"] > 0,
            5,
            "decode holds blocks",
        )
    wait_for(disagg.idle, 10, "blocks freed on both sides after cancel")


def test_pause_reaches_both_pools_and_held_requests_run_after_resume(
    disagg: Disagg, agg_reference: list
) -> None:
    """/pause in P/D: ``keep`` freezes a decoding stream and it ends whole after /resume;
    ``abort`` ends one (finish ``abort``), its prefilled KV dropped; a request sent while
    paused is held (by the prefill worker) and then gives the aggregated run's text."""
    wait_for(disagg.idle, 10, "idle")
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="x", max_retries=0, timeout=60)
    kw: dict = dict(model=disagg.model, prompt=PROMPTS[25], temperature=0,
                    extra_body={"ignore_eos": True})  # fmt: skip

    def stream(n: int) -> Iterator[tuple[str, str | None]]:
        for chunk in client.completions.create(max_tokens=n, stream=True, **kw):
            yield chunk.choices[0].text, chunk.choices[0].finish_reason

    def pause(mode: str) -> None:
        body = httpx.post(f"{disagg.url}/pause", params={"mode": mode}, timeout=60).json()
        assert body["status"] == "paused", body
        assert {w["pool"] for w in body["workers"].values()} == {"prefill", "decode"}

    kept = stream(300)
    head = [next(kept) for _ in range(10)]
    pause("keep")
    time.sleep(1.0)
    httpx.post(f"{disagg.url}/resume", timeout=60)
    chunks = head + list(kept)
    assert chunks[-1][1] == "length"
    assert "".join(t for t, _ in chunks) == client.completions.create(max_tokens=300, **kw)\
        .choices[0].text  # fmt: skip
    aborted = stream(1000)
    for _ in range(10):
        next(aborted)
    pause("abort")
    assert list(aborted)[-1][1] == "abort"
    out: list = []
    t = threading.Thread(target=lambda: out.append(asyncio.run(_complete_all(
        disagg.url, disagg.model, [PROMPTS[3]], [OUT[3]]))), daemon=True)  # fmt: skip
    t.start()
    time.sleep(1.0)
    assert t.is_alive()  # held while paused
    httpx.post(f"{disagg.url}/resume", timeout=60)
    t.join(60)
    assert out and out[0][0] == agg_reference[3]
    wait_for(disagg.idle, 10, "idle after the pauses")


def test_kv_never_pulled_is_freed_after_timeout(disagg: Disagg) -> None:
    """A decode that never comes (its worker vanished): the prefill worker's pinned blocks
    are freed after CONVEYOR_KV_PIN_TIMEOUT_S (3 s here)."""
    from celery import chain

    from kvbm.protocol import StagePayload
    from tasks.app import queue, route_to
    from tasks.stages import decode, prefill

    wait_for(disagg.idle, 10, "idle")
    _celery_for(disagg)
    pid = f"{disagg.prefill.name[:-8]}-p"
    before = disagg.loads()[pid]["pins_expired"]
    p = StagePayload(
        request_id="orphan-1",
        model=disagg.model,
        prompt_token_ids=PROMPTS[15],
        sampling={"max_tokens": 5, "temperature": 0},
        created=time.time(),
    )
    chain(
        prefill.si(p.model_dump()).set(queue=queue(f"prefill.{pid}")),
        decode.s(p.model_dump()).set(**route_to("decode.nobody")),
    ).apply_async()
    wait_for(lambda: disagg.loads()[pid]["blocks_pinned"] == 1, 10, "prefill pinned its KV")
    wait_for(lambda: disagg.loads()[pid]["blocks_pinned"] == 0, 10, "pinned KV expired")
    info = disagg.loads()[pid]
    assert info["pins_expired"] == before + 1
    assert info["blocks_used"] == 0


def _celery_for(d: Disagg) -> None:
    celery_at(d.redis_url, mode="disagg")


def _listen(redis_url: str, rid: str) -> redis.client.PubSub:
    ps = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    ps.subscribe(f"tokens:{rid}")
    return ps


def _frames(ps: redis.client.PubSub, timeout: float = 30) -> list[dict]:
    frames: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = ps.get_message(timeout=1.0)
        if msg is None:
            continue
        frames.append(json.loads(msg["data"]))
        if frames[-1].get("done"):
            return frames
    raise AssertionError(f"stream did not end: {frames}")


def _lost_handle(disagg: Disagg, rid: str, first_token: int) -> dict:
    """A handle whose KV is gone: its prefill worker vanished after handing it over."""
    layout = disagg.loads()[f"{disagg.prefill.name[:-8]}-p"]
    assert layout
    meta = {
        "backend": "redis",
        "request_id": f"{rid}-gone",
        "chunks": 1,
        "nbytes": 1,
        "num_blocks": 1,
        "layout": None,
        "agent": "conveyor-gone",
        "block_ids": [0],
        "base": 0,
        "devid": 0,
    }
    return {
        "request_id": rid,
        "prefill_worker": "gone-worker",
        "finished": False,
        "first_token": first_token,
        "emitted_chars": 0,
        "prompt_tokens": 0,
        "transfer": meta,
    }


def test_failed_pull_prefills_again_elsewhere(disagg: Disagg, agg_reference: list) -> None:
    """The decode worker cannot pull (prefill worker gone): the request is prefilled again
    on a live prefill worker, keeping the first token, and completes exactly as agg."""
    from kvbm.protocol import StagePayload
    from tasks.app import queue
    from tasks.stages import decode

    _celery_for(disagg)
    i = 17  # 255-token prompt
    ids = httpx.post(
        f"{disagg.url}/v1/completions",
        timeout=30,
        json={"model": disagg.model, "prompt": PROMPTS[i], "max_tokens": 1, "temperature": 0},
    )
    assert ids.status_code == 200
    rid = "redo-1"
    ps = _listen(disagg.redis_url, rid)
    p = StagePayload(
        request_id=rid,
        model=disagg.model,
        prompt_token_ids=PROMPTS[i],
        sampling={"max_tokens": OUT[i], "temperature": 0, "ignore_eos": True},
        created=time.time(),
    )
    first = _first_token(disagg, PROMPTS[i])
    decode.s(_lost_handle(disagg, rid, first), p.model_dump()).set(
        queue=queue(f"decode.{disagg.decode.name[:-7]}-d")
    ).apply_async()
    frames = _frames(ps)
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert frames[0]["token_ids"] == [first]
    assert frames[-1]["finish_reason"] == "length"
    assert frames[-1]["usage"]["completion_tokens"] == OUT[i]
    assert "".join(f["text"] for f in frames) == agg_reference[i][0]
    wait_for(disagg.idle, 10, "idle after the redo")


def test_failed_pull_past_retry_limit_ends_with_error(disagg: Disagg) -> None:
    from kvbm.protocol import StagePayload
    from tasks.app import queue
    from tasks.stages import decode

    _celery_for(disagg)
    rid = "redo-limit"
    ps = _listen(disagg.redis_url, rid)
    p = StagePayload(
        request_id=rid,
        model=disagg.model,
        prompt_token_ids=PROMPTS[5],
        sampling={"max_tokens": 4, "temperature": 0},
        created=time.time(),
        attempt=2,  # retried twice already: the limit (CONVEYOR_PREFILL_RETRIES=2)
    )
    decode.s(_lost_handle(disagg, rid, 7), p.model_dump()).set(
        queue=queue(f"decode.{disagg.decode.name[:-7]}-d")
    ).apply_async()
    frames = _frames(ps)
    assert len(frames) == 1 and frames[0]["seq"] == 1  # frame 0 came from the prefill worker
    assert frames[0]["error"]["code"] == "kv_transfer_failed"
    wait_for(disagg.idle, 10, "idle")


def _first_token(disagg: Disagg, prompt: list[int]) -> int:
    rid = f"probe-{time.monotonic_ns()}"
    ps = _listen(disagg.redis_url, rid)
    from kvbm.protocol import StagePayload
    from tasks.app import queue
    from tasks.stages import generate

    _celery_for(disagg)
    p = StagePayload(
        request_id=rid,
        model=disagg.model,
        prompt_token_ids=prompt,
        sampling={"max_tokens": 1, "temperature": 0},
        created=time.time(),
    )
    generate.si(p.model_dump()).set(
        queue=queue(f"decode.{disagg.decode.name[:-7]}-d")
    ).apply_async()
    return _frames(ps)[0]["token_ids"][0]


# ----------------------------------------------------------------------------------------
# Fallbacks: same tokens, counted by reason
# ----------------------------------------------------------------------------------------


def _metric(url: str, line_start: str) -> float:
    for ln in httpx.get(f"{url}/metrics").text.splitlines():
        if ln.startswith(line_start):
            return float(ln.split()[-1])
    return 0.0


def test_short_prompt_prefills_on_decode_worker(
    disagg: Disagg, agg_reference: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = base_env(
        disagg.redis_url,
        tiny_model_dir,
        CONVEYOR_MODE="disagg",
        CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="64",
    )
    api, url = start_api("api-threshold", env, tmp_path)
    try:
        idx = [i for i, p in enumerate(PROMPTS) if len(p) < 64][:5]
        got = asyncio.run(
            _complete_all(url, disagg.model, [PROMPTS[i] for i in idx], [OUT[i] for i in idx])
        )
        assert got == [agg_reference[i] for i in idx]
        key = 'conveyor_disagg_fallbacks_total{reason="short_prompt"}'
        assert _metric(url, key) == len(idx)
    finally:
        api.stop()


def test_prefill_pin_runs_the_prefill_stage_there_and_extra_fields_name_both_workers(
    disagg: Disagg, agg_reference: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Dynamo's nvext in P/D: a short prompt (under the API's threshold) prefills on its
    decode worker, unless ``prefill_worker_id`` (or the x-prefill-instance-id header) pins a
    prefill worker, which then prefills it; ``extra_fields`` name the worker of each stage.
    A prefill pin that names no prefill worker is a 400 naming it."""
    env = base_env(disagg.redis_url, tiny_model_dir, CONVEYOR_MODE="disagg",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="64")  # fmt: skip
    api, url = start_api("api-nvext", env, tmp_path)
    r = redis.Redis.from_url(disagg.redis_url)
    pre, dec = (json.loads(r.get(next(r.scan_iter(worker_key(pool, "*")))))["worker_id"]
                for pool in ("prefill", "decode"))  # fmt: skip
    i = next(i for i, p in enumerate(PROMPTS) if 16 < len(p) < 64)

    def run(nvext: dict, **headers: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
            "model": disagg.model, "prompt": PROMPTS[i], "max_tokens": OUT[i], "temperature": 0,
            "ignore_eos": True, "nvext": {"extra_fields": ["worker_id"], **nvext}})  # fmt: skip

    try:
        alone = run({})
        assert alone.json()["nvext"]["worker_id"] == {"prefill_worker_id": dec,
                                                      "decode_worker_id": dec}  # fmt: skip
        for pinned in (run({"prefill_worker_id": pre}), run({}, **{"x-prefill-instance-id": pre})):
            body = pinned.json()
            assert body["nvext"]["worker_id"] == {"prefill_worker_id": pre,
                                                  "decode_worker_id": dec}, body  # fmt: skip
            assert body["choices"][0]["text"] == agg_reference[i][0]
        bad = run({"prefill_worker_id": dec})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "nvext.prefill_worker_id"
    finally:
        api.stop()


def test_no_prefill_pool_runs_aggregated_on_decode(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, agg_reference: list
) -> None:
    env = base_env(
        fresh_db, tiny_model_dir, CONVEYOR_MODE="disagg", CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0"
    )
    dec = start_worker("solo-decode", "decode", "solo-d", env, tmp_path)
    with stop_on_error(dec):
        api, url = start_api("api-solo", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 90, "decode", [dec])
        assert httpx.get(f"{url}/health").json()["workers"] == {"prefill": 0, "decode": 1}
        idx = [3, 12, 20, 29]
        got = asyncio.run(
            _complete_all(
                url, tiny_model_dir.name, [PROMPTS[i] for i in idx], [OUT[i] for i in idx]
            )
        )
        assert got == [agg_reference[i] for i in idx]
        key = 'conveyor_disagg_fallbacks_total{reason="no_prefill_worker"}'
        assert _metric(url, key) == len(idx)
    finally:
        api.stop()
        dec.stop()
