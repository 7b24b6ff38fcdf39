"""The media guard (api/media.py) against a real local HTTP(S) server: what it fetches and
decodes, and every refusal, each a 400 whose code names the reason and whose param names
the image part. A stub resolver stands in for DNS where a test needs a host name that
only it knows (never the thing under test: the guard's checks and connections are real)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from api.errors import OpenAIError
from api.media import (
    ImageInput,
    LoadedImage,
    MediaGuard,
    forbidden_reason,
    image_hash,
)
from api.metrics import ApiMetrics
from tasks.settings import MultimodalSettings
from tests.media_server import ImageServer, encode, make_cert, picture, png_bomb

PIC = picture()
PNG = encode(PIC, "PNG")
FILES = {
    "a.png": (PNG, "image/png"),
    "a.jpg": (encode(PIC, "JPEG", quality=90), "image/jpeg"),
    "a.webp": (encode(PIC, "WEBP", lossless=True), "image/webp"),
    "a.gif": (encode(PIC.convert("P"), "GIF"), "image/gif"),
    "a.bmp": (encode(PIC, "BMP"), "image/bmp"),
    "octet.png": (PNG, "application/octet-stream"),
    "page.html": (b"<!doctype html><html><body>hi</body></html>", "text/html"),
    "pic.svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="9"/>', "image/svg+xml"),
    "svg-as-octets": (b'<svg xmlns="http://www.w3.org/2000/svg"/>', "application/octet-stream"),
    "truncated.png": (PNG[: len(PNG) // 2], "image/png"),
    "garbage.png": (bytes(range(256)) * 4, "image/png"),
    "bomb.png": (png_bomb(12_000), "image/png"),
    "big.png": (encode(picture(300, 300), "PNG"), "image/png"),
}
OPEN = MultimodalSettings(allow_http=True, allow_internal=True)  # the success path's settings


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with ImageServer(FILES).running() as s:
        yield s


def load(limits: MultimodalSettings, *urls: str, **kw: object) -> list[LoadedImage]:
    async def main() -> list[LoadedImage]:
        guard = MediaGuard(limits, **kw)  # type: ignore[arg-type]
        try:
            return await guard.load([ImageInput(u, f"messages.0.content.{i}.image_url")
                                     for i, u in enumerate(urls)])  # fmt: skip
        finally:
            await guard.aclose()

    return asyncio.run(main())


def refused(limits: MultimodalSettings, *urls: str, **kw: object) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        load(limits, *urls, **kw)
    e = info.value
    assert e.status == 400 and e.type == "invalid_request_error", e.body()
    if e.code != "too_many_images":  # that one is the request's, not one part's
        assert e.param is not None and e.param.startswith("messages.0.content."), e.body()
    return e


def data_url(body: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(body).decode()}"


# ======================================================================================
# What passes
# ======================================================================================
def test_every_allowed_format_over_http_and_as_a_data_url(server: ImageServer) -> None:
    names = ["a.png", "a.jpg", "a.webp", "a.gif", "a.bmp", "octet.png"]
    got = load(OPEN, *(server.url(f"/img/{n}") for n in names))
    assert [g.format for g in got] == ["PNG", "JPEG", "WEBP", "GIF", "BMP", "PNG"]
    assert all((g.width, g.height) == (40, 30) for g in got)
    assert got[0].data == PNG  # the bytes as fetched, for the workers
    # the same pixels hash alike whatever the lossless encoding or the way they came
    lossless = {got[i].hash for i in (0, 2, 4, 5)}
    assert lossless == {image_hash(PIC)}
    assert got[1].hash != got[0].hash  # JPEG is lossy: other pixels, another hash
    [inline] = load(MultimodalSettings(), data_url(PNG))  # data URLs need no fetch settings
    assert inline.hash == got[0].hash and inline.data == PNG


def test_the_hash_is_of_the_pixels_the_model_sees() -> None:
    assert image_hash(PIC) == image_hash(PIC.copy())
    assert image_hash(PIC) != image_hash(picture(seed=1))
    # same bytes, other shape: other image
    flat = Image.frombytes("RGB", (30, 40), PIC.tobytes())
    assert image_hash(flat) != image_hash(PIC)
    # transparency is composited onto white (transformers' convert_to_rgb), so a fully
    # transparent image is a white one, whatever colour its hidden pixels hold
    clear = Image.new("RGBA", (8, 8), (10, 200, 30, 0))
    assert image_hash(clear) == image_hash(Image.new("RGB", (8, 8), (255, 255, 255)))
    half = Image.new("RGBA", (8, 8), (0, 0, 0, 128))
    assert image_hash(half) not in (image_hash(clear), image_hash(Image.new("RGB", (8, 8))))


def test_a_requests_images_are_fetched_at_once_with_one_shared_pool(server: ImageServer) -> None:
    # /barrier answers only once two requests wait in it together: sequential fetches
    # would fail (500 after 5 s)
    got = load(OPEN, server.url("/barrier"), server.url("/barrier"))
    assert len(got) == 2

    async def twice() -> None:
        guard = MediaGuard(OPEN)
        try:
            for _ in range(3):
                await guard.load([ImageInput(server.url("/img/a.png"), "p")])
        finally:
            await guard.aclose()

    before = set(server.peers)
    asyncio.run(twice())
    assert len(server.peers - before) == 1  # three fetches, one kept-alive connection


def test_a_host_is_resolved_once_and_connected_to_as_resolved_keeping_its_name(
    server: ImageServer,
) -> None:
    """The socket goes to the address the guard resolved and checked (a name only the stub
    resolver knows still reaches the server: there is no second lookup), and the server
    sees the URL's host name in Host; each redirect hop to a new host is resolved (and
    checked) again."""
    calls: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        calls.append((host, port))
        return ["127.0.0.1"]

    target = server.url("/img/a.png", host="b.images.test")
    first = server.url(f"/redirect?to={target}", host="a.images.test")
    [got] = load(OPEN, first, resolver=resolver)
    assert got.hash == image_hash(PIC)
    assert calls == [("a.images.test", server.port), ("b.images.test", server.port)]
    assert server.seen[-2][1] == f"a.images.test:{server.port}"
    assert server.seen[-1] == ("/img/a.png", f"b.images.test:{server.port}")
    # the same stub with the check on: the name resolves to loopback, so it is refused
    e = refused(MultimodalSettings(allow_http=True), first, resolver=resolver)
    assert e.code == "image_url_forbidden" and "a.images.test" in e.message


def test_https_verifies_the_urls_host_name_on_the_checked_address(tmp_path: Path) -> None:
    tls = make_cert(tmp_path)
    if tls is None:
        pytest.skip("no openssl binary to make a test certificate")
    with ImageServer(FILES).running(tls) as s:
        ca = MultimodalSettings(allow_internal=True, ca_bundle=tls[0])  # https only (the default)
        [got] = load(ca, s.url("/img/a.png", host="localhost"))
        assert got.data == PNG

        # SNI and the certificate check use the URL's name, not the address connected to:
        # a name the certificate does not hold fails, though it resolves to the same place
        async def resolver(host: str, port: int) -> list[str]:
            return ["127.0.0.1"]

        e = refused(ca, s.url("/img/a.png", host="other.test"), resolver=resolver)
        assert e.code == "image_fetch_failed"
        # without the CA bundle the self-signed certificate is not trusted
        e = refused(MultimodalSettings(allow_internal=True), s.url("/img/a.png", host="localhost"))
        assert e.code == "image_fetch_failed"
        # a redirect hop is checked like the first: https -> http is refused by default
        down = s.url("/redirect?to=http://localhost:1/img/a.png", host="localhost")
        e = refused(ca, down)
        assert e.code == "image_url_forbidden" and "http://" in e.message


# ======================================================================================
# Refusals
# ======================================================================================
@pytest.mark.parametrize(
    ("host", "why"),
    [("127.0.0.1", "loopback"), ("10.0.0.1", "private"), ("169.254.169.254", "link-local"),
     ("[::1]", "loopback"), ("localhost", "loopback"), ("[::ffff:127.0.0.1]", "loopback"),
     ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("192.168.1.1", "private"),
     ("[fe80::1]", "link-local"), ("[fc00::1]", "private")],
)  # fmt: skip
def test_internal_addresses_are_refused_after_resolution(host: str, why: str) -> None:
    # nothing listens on these (the refusal comes before any connection)
    e = refused(MultimodalSettings(allow_http=True), f"http://{host}:9/img.png")
    assert e.code == "image_url_forbidden"
    assert f"a {why} address" in e.message and "CONVEYOR_MEDIA_ALLOW_INTERNAL" in e.message


def test_the_address_rule() -> None:
    for public in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"):
        assert forbidden_reason(public) is None, public
    assert forbidden_reason("100.64.0.1") == "non-public"  # carrier-grade NAT
    assert forbidden_reason("2002:7f00:1::") == "loopback"  # 6to4 of 127.0.0.1
    assert forbidden_reason("64:ff9b::a00:1") == "private"  # NAT64 of 10.0.0.1
    assert forbidden_reason("fe80::1%eth0") == "link-local"
    assert forbidden_reason("240.0.0.1") == "reserved"


def test_only_https_and_data_urls_by_default(server: ImageServer) -> None:
    for url, word in [(server.url("/img/a.png"), "CONVEYOR_MEDIA_ALLOW_HTTP"),
                      ("file:///etc/passwd", "file"), ("ftp://example.com/a.png", "ftp"),
                      ("/relative.png", "relative")]:  # fmt: skip
        e = refused(MultimodalSettings(allow_internal=True), url)
        assert e.code == "image_url_forbidden" and word in e.message, e.message


def test_a_fetch_that_takes_too_long(server: ImageServer) -> None:
    limits = MultimodalSettings(allow_http=True, allow_internal=True, fetch_timeout_s=0.5)
    t = time.monotonic()
    e = refused(limits, server.url("/slow?s=3"))
    assert e.code == "image_fetch_timeout" and "0.5 s" in e.message
    assert time.monotonic() - t < 2.5  # given up at the limit, not when the server answered


def test_bodies_over_the_byte_limit(server: ImageServer) -> None:
    limits = MultimodalSettings(allow_http=True, allow_internal=True, max_bytes=100_000,
                         fetch_timeout_s=20)  # fmt: skip
    # a body with no end: only reading it as a stream and stopping at the limit ends it
    e = refused(limits, server.url("/endless"))
    assert e.code == "image_too_large" and "100000 bytes" in e.message
    e = refused(limits, server.url("/declared-big"))  # refused on its Content-Length
    assert e.code == "image_too_large"
    small = MultimodalSettings(max_bytes=len(PNG) - 1)
    e = refused(small, data_url(PNG))
    assert e.code == "image_too_large" and "CONVEYOR_MEDIA_MAX_BYTES" in e.message
    assert load(MultimodalSettings(max_bytes=len(PNG)), data_url(PNG))[0].data == PNG


def test_too_many_pixels_and_a_decompression_bomb(server: ImageServer) -> None:
    limits = MultimodalSettings(allow_http=True, allow_internal=True, max_pixels=200 * 200)
    e = refused(limits, server.url("/img/big.png"))
    assert e.code == "image_too_large" and "300x300" in e.message
    assert "CONVEYOR_MEDIA_MAX_PIXELS" in e.message
    bomb = FILES["bomb.png"][0]
    assert len(bomb) < 50_000  # a few KB that would decode to 144 M pixels
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow's, at open (header only)
        e = refused(OPEN, server.url("/img/bomb.png"))  # our limit, before decoding
    assert e.code == "image_too_large" and "CONVEYOR_MEDIA_MAX_PIXELS" in e.message
    # a limit set above Pillow's bomb limit does not switch that one off
    lax = MultimodalSettings(allow_http=True, allow_internal=True, max_pixels=10**9)
    with pytest.warns(Image.DecompressionBombWarning):
        e = refused(lax, server.url("/img/bomb.png"))
    assert e.code == "image_too_large" and "decompression-bomb limit" in e.message


def test_corrupt_images(server: ImageServer) -> None:
    for name in ("truncated.png", "garbage.png"):
        e = refused(OPEN, server.url(f"/img/{name}"))
        assert e.code == "invalid_image", (name, e.message)
    for url in (data_url(PNG[:40]), "data:image/png;base64,not base64!",
                "data:image/png,rawbytes", "data:image/png;base64"):  # fmt: skip
        assert refused(OPEN, url).code == "invalid_image", url


def test_unsupported_types(server: ImageServer, tmp_path: Path) -> None:
    for name, shown in [("page.html", "text/html"), ("pic.svg", "image/svg+xml"),
                        ("svg-as-octets", "SVG")]:  # fmt: skip
        e = refused(OPEN, server.url(f"/img/{name}"))
        assert e.code == "unsupported_image_type" and shown in e.message, e.message
    svg = FILES["pic.svg"][0]
    for url in (data_url(svg, "image/svg+xml"), data_url(b"<p>hi</p>", "text/html"),
                data_url(encode(PIC, "TIFF"), "image/tiff")):  # fmt: skip
        e = refused(OPEN, url)
        assert e.code == "unsupported_image_type" and "PNG, JPEG" in e.message, e.message


def test_too_many_images_refused_before_any_fetch(server: ImageServer) -> None:
    n = len(server.seen)
    e = refused(MultimodalSettings(allow_http=True, allow_internal=True, max_images=2),
                *[server.url("/img/a.png")] * 3)  # fmt: skip
    assert e.code == "too_many_images" and e.param == "messages"
    assert "at most 2" in e.message
    assert len(server.seen) == n  # nothing fetched


def test_redirects_are_bounded(server: ImageServer) -> None:
    e = refused(OPEN, server.url("/loop"))
    assert e.code == "image_fetch_failed" and "redirects" in e.message
    assert refused(OPEN, server.url("/img/missing.png")).code == "image_fetch_failed"


def test_the_first_refusal_in_prompt_order_names_its_part(server: ImageServer) -> None:
    e = refused(OPEN, data_url(PNG), server.url("/slow?s=0.3"), server.url("/img/page.html"))
    assert e.param == "messages.0.content.2.image_url"


def test_metrics(server: ImageServer) -> None:
    m = ApiMetrics()
    load(OPEN, server.url("/img/a.png"), data_url(PNG), metrics=m)
    refused(OPEN, server.url("/img/page.html"), metrics=m)
    refused(MultimodalSettings(), server.url("/img/a.png"), metrics=m)

    def value(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    assert value("conveyor_images_received_total", source="url") == 1
    assert value("conveyor_images_received_total", source="data") == 1
    assert value("conveyor_image_fetch_seconds_count") == 3  # every fetch, refused or not
    assert value("conveyor_image_refusals_total", reason="unsupported_image_type") == 1
    assert value("conveyor_image_refusals_total", reason="image_url_forbidden") == 1
