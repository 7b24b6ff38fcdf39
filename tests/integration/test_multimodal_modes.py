"""Image requests through every serving mode and transfer backend (real redis-server, real
encode / prefill / decode / generate worker processes, real HTTP, the official openai
client), token for token against Hugging Face ``LlavaForConditionalGeneration.generate``
with ``AutoProcessor`` on the same checkpoint and images.

    agg    EPD    one generate worker encodes, prefills and decodes
    e-pd   E/PD   an encode worker, then a generate worker (embeddings transferred)
    e-p-d  E/P/D  encode, prefill and decode workers (embeddings, then KV transferred)
    ep-d   EP/D   a prefill worker that encodes, then a decode worker (KV transferred)

Thirteen requests (1 to 3 images of different sizes and formats, text before, between and
after them, a repeated image, prompts crossing block boundaries) run at once in each
deployment; afterwards every worker's KV blocks and staged embeddings are back to zero.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import redis
import transformers

from cluster.keys import worker_key
from kvbm.protocol import embedding_key, media_key
from tasks.modes import get_mode
from tests.integration.conftest import (
    Proc,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.unit.workers.test_engine_mm import IMAGES, REQUESTS, _build_cases
from workers.transfer.nixl_kv import nixl_available

pytestmark = pytest.mark.integration

CHAT = [(parts, n) for parts, n, chat in REQUESTS if chat]
STAGED = embedding_key("*", "*")  # every image embedding staged in Redis for a pull
DEPLOYMENTS = [("agg", "redis"), ("e-pd", "redis"), ("e-p-d", "redis"), ("ep-d", "redis")]
DEPLOYMENTS += [(m, "nixl") for m in ("e-pd", "e-p-d", "ep-d")] if nixl_available() else []


def _data_url(name: str) -> str:
    img = IMAGES[name]
    fmt = img.open().format.lower()
    return f"data:image/{fmt};base64,{base64.b64encode(img.data).decode()}"


def _messages(parts: list[str]) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": _data_url(p[1:])}}
               if p.startswith("@") and p[1:] in IMAGES else {"type": "text", "text": p}
               for p in parts]  # fmt: skip
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def hf_texts(tiny_model_dir: Path) -> list[str]:
    """Hugging Face's greedy continuation of each request, as text."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    cases = _build_cases(tiny_model_dir, [(p, n, True) for p, n in CHAT])
    return [tok.decode(c.hf, skip_special_tokens=True) for c in cases]


@contextmanager
def deployment(
    url: str, model: Path, logdir: Path, mode: str, backend: str,
    encoders: int = 1, **extra: str,
) -> Iterator[tuple[str, list[Proc], str]]:  # fmt: skip
    """One worker per pool of ``mode`` (``encoders`` in the encode pool) and an API, on
    the Redis database ``url`` (the test's fresh_db)."""
    env = base_env(url, model, CONVEYOR_MODE=mode, CONVEYOR_KV_TRANSFER=backend,
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0", CONVEYOR_MEDIA_ALLOW_INTERNAL="true",
                   **extra)  # fmt: skip
    pools = get_mode(mode).pools
    workers = [start_worker(f"{mode}-{backend}-{p}", p, f"{p}-w", env, logdir) for p in pools]
    workers += [start_worker(f"{mode}-{backend}-encode{i}", "encode", f"encode-w{i}", env, logdir)
                for i in range(1, encoders if "encode" in pools else 0)]  # fmt: skip
    with stop_on_error(*workers):
        api, api_url = start_api(f"{mode}-{backend}-api", env, logdir)
    procs = [*workers, api]
    try:
        # every pool's worker registered (an optional stage's absence is no error for
        # /health, but the test wants every stage to run where the mode puts it)
        wait_for(lambda: all(httpx.get(f"{api_url}/health", timeout=1).json()["workers"][p]
                             >= 1 for p in pools), 120, f"{mode} healthy", procs)  # fmt: skip
        yield api_url, procs, url
    finally:
        for p in procs:
            p.stop()


async def _chat(url: str, model: str, parts: list[str], n: int) -> tuple[str, dict]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        out = await client.chat.completions.create(
            model=model,
            messages=_messages(parts),
            max_tokens=n,
            temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].message.content or "", out.usage.model_dump()
    finally:
        await client.close()


def _reports(url: str) -> dict[str, dict]:
    r = redis.Redis.from_url(url)
    out = {}
    for key in r.scan_iter(worker_key("*", "*")):
        raw = r.get(key)
        if raw:
            info = json.loads(raw)
            out[info["worker_id"]] = info
    return out


def _idle(url: str) -> bool:
    """No worker holds a KV block or a request (as their last heartbeats report)."""
    return all(w.get("blocks_used", 0) == 0 and w.get("active", 0) == 0
               for w in _reports(url).values())  # fmt: skip


@pytest.mark.parametrize(("mode", "backend"), DEPLOYMENTS, ids=lambda x: x)
def test_every_mode_and_backend_gives_hf_tokens(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, hf_texts: list[str], mode: str,
    backend: str,
) -> None:  # fmt: skip
    with deployment(fresh_db, tiny_model_dir, tmp_path, mode, backend) as (url, procs, rurl):

        async def run_all() -> list[tuple[str, dict]]:
            return await asyncio.gather(*(_chat(url, tiny_model_dir.name, p, n)
                                          for p, n in CHAT))  # fmt: skip

        got = asyncio.run(run_all())
        for i, ((text, usage), want) in enumerate(zip(got, hf_texts, strict=True)):
            assert text == want, (i, CHAT[i][0], text, want)
            assert usage["completion_tokens"] == CHAT[i][1]
        # every stage ran where the mode says: no fallback, each pool's worker busy
        metrics = httpx.get(f"{url}/metrics").text
        assert "conveyor_disagg_fallbacks_total{" not in metrics, metrics
        logs = {p.name: p.log.read_text() for p in procs}
        if "encode" in get_mode(mode).pools:
            assert "image(s) encoded" in logs[f"{mode}-{backend}-encode"]
        if "prefill" in get_mode(mode).pools:
            assert "prefilled" in logs[f"{mode}-{backend}-prefill"]
        # the vision tower ran on the workers the mode says encode, and only there; nothing
        # is left held: KV blocks on every worker, embeddings staged in Redis (the reports
        # are a heartbeat behind)
        want_encoders = {"agg": {"generate-w"}, "e-pd": {"encode-w"}, "e-p-d": {"encode-w"},
                         "ep-d": {"prefill-w"}}[mode]  # fmt: skip

        def encoders() -> set[str]:
            return {w for w, rep in _reports(rurl).items()
                    if rep.get("images", {}).get("images_encoded", 0) > 0}  # fmt: skip

        wait_for(lambda: encoders() == want_encoders, 15, "encoders reported", procs)
        wait_for(lambda: all(w.get("blocks_used", 0) == 0 for w in _reports(rurl).values()),
                 15, "blocks freed", procs)  # fmt: skip
        r = redis.Redis.from_url(rurl)
        wait_for(lambda: not list(r.scan_iter(STAGED)), 15, "embeddings freed", procs)
        imgs = {w: rep.get("images", {}) for w, rep in _reports(rurl).items()}
        assert encoders() == want_encoders, imgs
        # ... and /metrics says so: images through the tower, embeddings pulled across
        # (each worker's numbers are as fresh as its last heartbeat)
        pulled_by = {"agg": set(), "e-pd": {"generate-w"}, "e-p-d": {"prefill-w", "decode-w"},
                     "ep-d": {"decode-w"}}[mode]  # fmt: skip

        def transfers() -> dict[str, float]:
            lines = httpx.get(f"{url}/metrics").text.splitlines()
            head = f'conveyor_embedding_transfers_total{{backend="{backend}",worker="'
            return {x[len(head):].split('"')[0]: float(x.split()[-1])
                    for x in lines if x.startswith(head)}  # fmt: skip

        wait_for(lambda: all(transfers().get(w, 0) > 0 for w in pulled_by), 15,
                 "embedding pulls reported", procs)  # fmt: skip
        assert {w for w, n in transfers().items() if n > 0} == pulled_by, transfers()

        def counted_alike() -> bool:  # /metrics and the reports read at different heartbeats
            metrics = httpx.get(f"{url}/metrics").text
            return all(f'conveyor_images_encoded_total{{pool="{w.removesuffix("-w")}",worker='
                       f'"{w}"}} {float(st["images"]["images_encoded"])}' in metrics
                       for w, st in _reports(rurl).items())  # fmt: skip

        wait_for(counted_alike, 15, "/metrics counting the reports' images", procs)
        assert all(st.get("pull_fallbacks", 0) == 0 for st in imgs.values()), imgs


def test_the_same_image_hits_both_caches_and_another_image_hits_neither(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    text = "Describe this picture in a few words, please, as precisely as you can."
    with deployment(fresh_db, tiny_model_dir, tmp_path, "e-pd", "redis") as (url, procs, rurl):
        model = tiny_model_dir.name
        a1, u1 = asyncio.run(_chat(url, model, ["@png", text], 8))
        a2, u2 = asyncio.run(_chat(url, model, ["@png", text], 8))
        b, ub = asyncio.run(_chat(url, model, ["@png2", text], 8))
        assert a1 == a2 and b != a1
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        assert u2["prompt_tokens_details"]["cached_tokens"] > 0  # the same image: KV reused
        assert ub["prompt_tokens_details"]["cached_tokens"] == 0  # another image: none
        # (a heartbeat may report the hit before the second image's encode: wait for both)
        wait_for(lambda: _reports(rurl)["encode-w"]["images"]["images_encoded"] >= 2
                 and _reports(rurl)["encode-w"]["images"]["cache_hits"] >= 1, 10,
                 "an embedding cache hit and a second image encoded", procs)  # fmt: skip
        assert _reports(rurl)["encode-w"]["images"]["images_encoded"] == 2  # png, png2


def test_a_failed_encode_ends_the_request_with_an_error(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The image's bytes in Redis do not decode by the time the encode worker reads them:
    the request ends with an error saying so, and the deployment goes on serving."""
    from api.media import image_hash

    with deployment(fresh_db, tiny_model_dir, tmp_path, "e-pd", "redis") as (url, procs, rurl):
        r = redis.Redis.from_url(rurl)
        r.set(media_key(image_hash(IMAGES["jpeg"].open())), b"not an image any more", ex=600)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        # the error comes before the first token: the response has not started, so it is
        # a status (503: the image may be sent again), not an event inside a 200 stream
        with pytest.raises(openai.APIStatusError) as e:
            for _ in client.chat.completions.create(
                model=tiny_model_dir.name,
                messages=_messages(["@jpeg", "what?"]),  # type: ignore[arg-type]
                max_tokens=4,
                stream=True,
            ):
                pass
        assert e.value.status_code == 503, e.value
        assert "cannot be decoded" in str(e.value), e.value
        assert e.value.body["code"] == "image_unavailable", e.value.body  # type: ignore[index]
        text, _ = asyncio.run(_chat(url, tiny_model_dir.name, ["@png", "and this?"], 4))
        assert text  # the next image request is served
        # the failure left nothing held: KV blocks, staged embeddings
        wait_for(lambda: _idle(rurl), 15, "blocks freed", procs)
        wait_for(lambda: not list(r.scan_iter(STAGED)), 15, "embeddings freed", procs)


def test_no_live_encode_worker_the_pd_worker_encodes(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, hf_texts: list[str]
) -> None:
    with deployment(fresh_db, tiny_model_dir, tmp_path, "e-pd", "redis") as (url, procs, rurl):
        encode = next(p for p in procs if p.name.endswith("-encode"))
        encode.stop()
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"]["encode"] == 0, 30,
                 "the encode worker gone", procs[1:])  # fmt: skip
        text, _ = asyncio.run(_chat(url, tiny_model_dir.name, *CHAT[0]))
        assert text == hf_texts[0]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'conveyor_disagg_fallbacks_total{reason="no_encode_worker"} 1.0' in metrics


def test_a_frozen_encode_worker_its_requests_go_to_another(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, hf_texts: list[str]
) -> None:
    """One of two encode workers stops answering (SIGSTOP: it holds its tasks, its heartbeat
    lapses) and is then killed: the requests it held are sent again and answered by the
    other one, token for token, before any token reached the client."""
    import os
    import signal

    # round robin: the four requests go two to each encoder (an encode pick adds no load,
    # so KV routing breaks the tie at random and could leave the frozen one none: 1 in 16)
    with deployment(fresh_db, tiny_model_dir, tmp_path, "e-pd", "redis", encoders=2,
                    CONVEYOR_ROUTER_MODE="round_robin") as (url, procs, rurl):  # fmt: skip
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"]["encode"] == 2, 60,
                 "two encode workers", procs)  # fmt: skip
        frozen = next(p for p in procs if p.name.endswith("-encode"))
        os.killpg(frozen.popen.pid, signal.SIGSTOP)
        try:

            async def run_all() -> list[tuple[str, dict]]:
                return await asyncio.gather(*(_chat(url, tiny_model_dir.name, p, n)
                                              for p, n in CHAT[:4]))  # fmt: skip

            got = asyncio.run(run_all())
        finally:
            os.killpg(frozen.popen.pid, signal.SIGKILL)
        assert [t for t, _ in got] == hf_texts[:4]
        # the frozen encoder's two came back by either road: the API sent them again (its
        # stream watcher saw the worker die), or a router's prune moved them from its queue
        # to the pool's, whichever came first; the other encoder ran all four
        live = [p for p in procs if p is not frozen]
        wait_for(lambda: any(w.get("encode_requests", 0) >= 4 for w in _reports(rurl).values()),
                 15, "the live encoder ran all four", live)  # fmt: skip
        wait_for(lambda: all(w.get("blocks_used", 0) == 0 for w in _reports(rurl).values()),
                 15, "blocks freed", live)  # fmt: skip


def test_cancelled_image_requests_free_their_kv_and_embeddings(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """E/P/D: clients that go away after the first tokens leave nothing held anywhere."""
    with deployment(fresh_db, tiny_model_dir, tmp_path, "e-p-d", "redis") as (
        url,
        procs,
        rurl,
    ):

        async def cancel_one(parts: list[str]) -> int:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            try:
                stream = await client.chat.completions.create(
                    model=tiny_model_dir.name, messages=_messages(parts),  # type: ignore[arg-type]
                    max_tokens=400, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 3:
                        break
                await stream.close()
                return n
            finally:
                await client.close()

        async def run_all() -> list[int]:
            return await asyncio.gather(*(cancel_one(p) for p, _ in CHAT[:6]))

        assert asyncio.run(run_all()) == [3] * 6
        wait_for(lambda: float(next(x.split()[-1] for x in
                                    httpx.get(f"{url}/metrics").text.splitlines()
                                    if x.startswith("conveyor_requests_cancelled_total"))) >= 6,
                 15, "six cancellations", procs)  # fmt: skip

        wait_for(lambda: _idle(rurl), 20, "blocks freed", procs)
        r = redis.Redis.from_url(rurl)
        wait_for(lambda: not list(r.scan_iter(STAGED)), 15, "embeddings freed", procs)
