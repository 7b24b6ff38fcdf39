"""Image content parts through the real API (real redis-server, a real mock-engine worker,
real HTTP, the official openai client): each bad image answers 400 with its reason and
nothing reaches the broker or the worker; a good request is accepted, its images' bytes
are in Redis under media_key, and the message its worker received carries ImageRefs whose
offsets are the placeholders'.

Two API processes share the worker: ``guarded`` with the default media settings (its
refusals of internal addresses are the point), ``open`` with
CONVEYOR_MEDIA_ALLOW_INTERNAL=true and CONVEYOR_MEDIA_CA_BUNDLE naming the self-signed
certificate of a local HTTPS image server, so its fetches go over real TLS (https only:
CONVEYOR_MEDIA_ALLOW_HTTP stays off). The deployment has its own redis-server, so MONITOR
sees every command of this deployment and nothing else's.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import httpx
import openai
import pytest
import redis
from PIL import Image

from api.media import image_hash
from kvbm.protocol import media_key
from tests.integration.conftest import (
    Proc,
    base_env,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.media_server import ImageServer, encode, make_cert, picture, png_bomb

pytestmark = pytest.mark.integration

PIC_A, PIC_B = picture(40, 30, seed=0), picture(64, 48, seed=5)
PNG_A, PNG_B = encode(PIC_A, "PNG"), encode(PIC_B, "PNG")
FILES = {
    "a.png": (PNG_A, "image/png"),
    "b.jpg": (encode(PIC_B, "JPEG", quality=95), "image/jpeg"),
    "page.html": (b"<!doctype html><p>not an image</p>", "text/html"),
    "truncated.png": (PNG_A[: len(PNG_A) // 2], "image/png"),
    "bomb.png": (png_bomb(12_000), "image/png"),
}
IMAGE_TOKEN, IMAGE_TOKENS = 4, 16  # the tiny model's <image> id and image_seq_length


@dataclass
class Deployment:
    redis_url: str
    model: str
    guarded: str  # API base URLs
    open: str
    images: ImageServer
    procs: list[Proc]

    def client(self, base: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def mm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = tmp_path_factory.mktemp("mm")
    tls = make_cert(d)
    if tls is None:
        pytest.skip("no openssl binary to make the image server's certificate")
    redis_proc, url = start_redis(d)
    env = base_env(url, tiny_model_dir, CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP="20",
                   CONVEYOR_MEDIA_MAX_IMAGES="3", CONVEYOR_MEDIA_MAX_PIXELS=str(256 * 256),
                   CONVEYOR_MEDIA_FETCH_TIMEOUT_S="1")  # fmt: skip
    open_env = {**env, "CONVEYOR_MEDIA_ALLOW_INTERNAL": "true",
                "CONVEYOR_MEDIA_CA_BUNDLE": str(tls[0])}  # fmt: skip
    procs = [redis_proc]
    bases: dict[str, str] = {}
    with ImageServer(FILES).running(tls) as images, stop_on_error(*procs):
        procs.append(start_worker("mm-worker", "generate", "mm-w0", env, d))
        for name, e in (("guarded", env), ("open", open_env)):
            with stop_on_error(*procs):
                p, bases[name] = start_api(f"api-{name}", e, d)
            procs.append(p)
            wait_for(lambda b=bases[name]: httpx.get(f"{b}/health").status_code == 200, 90,
                     f"api-{name} healthy", procs)  # fmt: skip
        try:
            yield Deployment(url, tiny_model_dir.name, bases["guarded"], bases["open"],
                             images, procs)  # fmt: skip
        finally:
            for p in reversed(procs):
                p.stop()


class Monitor:
    """Every command the deployment's Redis runs while the block is open (MONITOR)."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.commands: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.r.monitor() as m:
            self._ready.set()
            for c in m.listen():
                if c["command"] == "ECHO monitor-stop":
                    return
                self.commands.append(c["command"])

    def __enter__(self) -> Monitor:
        self._thread.start()
        assert self._ready.wait(5)
        self.r.echo("monitor-start")  # MONITOR is on once its first command shows
        return self

    def __exit__(self, *exc: object) -> None:
        self.r.echo("monitor-stop")
        self._thread.join(10)

    def pushes(self) -> list[str]:
        """Messages sent to a Celery queue (kombu LPUSHes them)."""
        return [c for c in self.commands if c.split(" ", 1)[0] in ("LPUSH", "RPUSH")]

    def frames(self) -> list[str]:
        """Token frames a worker published (what running a request looks like)."""
        return [c for c in self.commands if c.startswith("PUBLISH tokens:")]


def _data_url(body: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(body).decode()}"


def _body(model: str, *parts: dict) -> dict:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def _img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BAD = [
    # (api, image URLs, code, text in the message); "{srv}" is the local image server
    ("guarded", ["https://127.0.0.1/a.png"], "image_url_forbidden", "loopback"),
    ("guarded", ["https://10.0.0.1/a.png"], "image_url_forbidden", "private"),
    ("guarded", ["https://169.254.169.254/latest/meta-data"], "image_url_forbidden",
     "link-local"),
    ("guarded", ["https://[::1]/a.png"], "image_url_forbidden", "loopback"),
    ("guarded", ["https://localhost/a.png"], "image_url_forbidden", "'localhost' resolves"),
    ("guarded", ["{srv}/img/a.png"], "image_url_forbidden", "loopback"),
    ("guarded", ["http://example.com/a.png"], "image_url_forbidden", "http://"),
    ("open", ["{srv}/slow?s=3"], "image_fetch_timeout", "1 s"),
    ("open", ["{srv}/img/truncated.png"], "invalid_image", "corrupt"),
    ("open", [_data_url(b"\x89PNG\r\n\x1a\nnot really")], "invalid_image", "corrupt"),
    ("open", ["{srv}/img/page.html"], "unsupported_image_type", "text/html"),
    ("guarded", [_data_url(b"<svg/>", "image/svg+xml")], "unsupported_image_type", "svg"),
    ("guarded", [_data_url(encode(picture(300, 300), "PNG"))], "image_too_large",
     "300x300"),
    ("open", ["{srv}/img/bomb.png"], "image_too_large", "pixels"),
    ("guarded", [_data_url(PNG_A)] * 4, "too_many_images", "at most 3"),
]  # fmt: skip


def test_bad_images_answer_400_and_nothing_reaches_a_worker(mm: Deployment) -> None:
    srv = mm.images.url("", host="localhost")
    with Monitor(mm.redis_url) as mon:
        for api, urls, code, words in BAD:
            base = mm.guarded if api == "guarded" else mm.open
            body = _body(mm.model, *(_img(u.replace("{srv}", srv)) for u in urls))
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400, (code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error"
            assert (err["code"], words in err["message"]) == (code, True), err
            expected = "messages" if code == "too_many_images" else \
                "messages.0.content.1.image_url"  # fmt: skip
            assert err["param"] == expected, err
    assert mon.commands, "MONITOR saw nothing: the check below would prove nothing"
    assert mon.pushes() == [] and mon.frames() == []  # no message sent, nothing ran
    # the openai client gets the same 400 as an exception it can read
    with pytest.raises(openai.BadRequestError) as e:
        mm.client(mm.guarded).chat.completions.create(
            model=mm.model, max_tokens=4,
            messages=[{"role": "user", "content": [_img("https://10.1.2.3/x.png")]}],
        )  # fmt: skip
    assert e.value.code == "image_url_forbidden"
    metrics = httpx.get(f"{mm.guarded}/metrics").text
    assert re.search(r'conveyor_image_refusals_total\{reason="image_url_forbidden"\} [1-9]',
                     metrics)  # fmt: skip


def test_a_good_image_request_carries_its_images_to_the_worker(mm: Deployment) -> None:
    """Three images — A inline, A again over https, B over https as JPEG — with text
    around them: the request is served, A's and B's bytes are in Redis once each, and the
    message on the worker's queue carries one ImageRef per image at its placeholders."""
    a_url = mm.images.url("/img/a.png", host="localhost")
    b_url = mm.images.url("/img/b.jpg", host="localhost")
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [
            {"type": "text", "text": "Is"}, _img(_data_url(PNG_A)),
            {"type": "text", "text": "the same as"},
            {"type": "image_url", "image_url": a_url},  # the plain-string form
            {"type": "text", "text": "and unlike"},
            {"type": "image_url", "image_url": {"url": b_url, "detail": "high"}},
            {"type": "text", "text": "?"},
        ]},
    ]  # fmt: skip
    with Monitor(mm.redis_url) as mon:
        out = mm.client(mm.open).chat.completions.create(model=mm.model, messages=messages,
                                                         max_tokens=4)  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length")
    [push] = [c for c in mon.pushes() if c.startswith("LPUSH generate.mm-w0 ")]
    m = re.search(r'"body": "([A-Za-z0-9+/=]+)"', push)
    assert m is not None, push[:300]
    args, _kwargs, _embed = json.loads(base64.b64decode(m.group(1)))
    payload = args[0]
    ids, refs = payload["prompt_token_ids"], payload["images"]
    assert out.usage.prompt_tokens == len(ids)  # placeholders are prompt tokens
    ha = image_hash(PIC_A)
    hb = image_hash(Image.open(BytesIO(FILES["b.jpg"][0])))  # the JPEG's pixels, decoded
    assert [r["hash"] for r in refs] == [ha, ha, hb]
    assert all(r["num_tokens"] == IMAGE_TOKENS for r in refs)
    offsets = [r["offset"] for r in refs]
    assert offsets == sorted(offsets) and ids.count(IMAGE_TOKEN) == 3 * IMAGE_TOKENS
    for off in offsets:
        assert ids[off : off + IMAGE_TOKENS] == [IMAGE_TOKEN] * IMAGE_TOKENS
        assert ids[off - 1] != IMAGE_TOKEN  # each run starts at its ref's offset
    # the bytes: once per distinct picture (A inline and A fetched are one), with a TTL
    r = redis.Redis.from_url(mm.redis_url)
    assert r.get(media_key(ha)) == PNG_A
    assert r.get(media_key(hb)) == FILES["b.jpg"][0]
    assert 0 < r.ttl(media_key(ha)) <= 600 and 0 < r.ttl(media_key(hb)) <= 600
    assert sum(c.startswith(f"SET {media_key(ha)} ") for c in mon.commands) == 1
    # no image bytes in the Celery message: only hashes and offsets
    assert base64.b64encode(PNG_A).decode()[:40] not in json.dumps(args)
    assert set(refs[0]) == {"hash", "offset", "num_tokens"}
    metrics = httpx.get(f"{mm.open}/metrics").text
    assert re.search(r'conveyor_images_received_total\{source="url"\} [2-9]', metrics)
    assert re.search(r"conveyor_image_fetch_seconds_count [2-9]", metrics)
