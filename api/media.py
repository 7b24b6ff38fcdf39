"""The media guard: fetch and decode a request's images, refusing what is unsafe or too big.

An image URL makes the API fetch what a client names, so every fetch is an attack surface
(server-side request forgery into the cluster, slow or endless bodies, decompression
bombs). What the guard lets through:

* ``data:image/...;base64,...`` URLs, and ``https://`` URLs (``http://`` only with
  ``CONVEYOR_MEDIA_ALLOW_HTTP``); nothing else.
* Every address a host name resolves to must be public: loopback, private, link-local,
  multicast, reserved and unspecified addresses (IPv4, IPv6, IPv4-mapped IPv6) are refused
  unless ``CONVEYOR_MEDIA_ALLOW_INTERNAL``. The connection goes to an address that was
  checked, resolved once (no second lookup an attacker's DNS could answer differently),
  with the URL's host name kept in the Host header and TLS SNI. Each redirect hop is
  checked again, at most MAX_REDIRECTS of them.
* Limits: encoded bytes (streamed, stopped at the limit), pixels, fetch time, images per
  request. Pillow decodes it (open, verify, load) as one of ALLOWED_FORMATS.

Each refusal is a 400 in OpenAI's shape whose ``code`` names the reason (the REFUSALS) and
whose ``param`` names the image part, raised before anything reaches a worker.

Public part:
    ImageInput      one image part of a request: its URL and where it was (``param``)
    LoadedImage     a checked image: its bytes as fetched, content hash, size, format
    MediaGuard      check_count, load (a request's images, concurrently, one shared
                    connection pool), store (their bytes into Redis under media_key)
    forbidden_reason   why an address may not be fetched from (None: it may)
    image_hash      the content hash of a decoded image (what ImageRef.hash holds)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from io import BytesIO
from urllib.parse import quote, urljoin, urlsplit

import httpcore
import redis.asyncio as aioredis
from PIL import Image, UnidentifiedImageError
from redis.exceptions import RedisError

from api.errors import OpenAIError, bad_request, redis_unavailable
from api.metrics import ApiMetrics
from kvbm.protocol import media_key
from tasks.settings import MultimodalSettings

log = logging.getLogger(__name__)

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's names
MAX_REDIRECTS = 5
# the reasons a refusal's ``code`` (and conveyor_image_refusals_total{reason}) can name
REFUSALS = ("too_many_images", "image_url_forbidden", "image_fetch_failed",
            "image_fetch_timeout", "image_too_large", "unsupported_image_type",
            "invalid_image")  # fmt: skip
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses embedded in IPv6 (RFC 6052)

# host, port -> the addresses it resolves to (tests pass their own: a stub DNS)
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class ImageInput:
    url: str
    param: str  # e.g. "messages.0.content.1.image_url"


@dataclass(frozen=True, slots=True)
class LoadedImage:
    data: bytes  # as fetched (encoded), what the workers decode again
    hash: str  # image_hash of the decoded pixels
    width: int
    height: int
    format: str  # one of ALLOWED_FORMATS


class MediaGuard:
    def __init__(
        self,
        limits: MultimodalSettings,
        metrics: ApiMetrics | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        # no CA bundle: httpcore's default context (certifi's roots)
        ctx = ssl.create_default_context(cafile=str(limits.ca_bundle)) \
            if limits.ca_bundle else None  # fmt: skip
        # One pool for every request's fetches (keep-alive to image hosts). Every
        # connection it opens goes through the guarded backend: resolve, check, connect.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ctx,
            max_connections=64,
            max_keepalive_connections=16,
            keepalive_expiry=30.0,
            network_backend=_GuardedBackend(resolver or _resolve, limits.allow_internal),
        )

    async def aclose(self) -> None:
        await self._pool.aclose()

    # ----------------------------------------------------------------------------------
    def check_count(self, images: list[ImageInput]) -> None:
        """Refuse a request with more images than allowed (before anything is fetched)."""
        n, limit = len(images), self.limits.max_images
        if n > limit:
            raise self._refuse(
                f"too many images: the request has {n}, at most {limit} are allowed "
                "(CONVEYOR_MEDIA_MAX_IMAGES)",
                "messages",
                "too_many_images",
            )

    async def load(self, images: list[ImageInput]) -> list[LoadedImage]:
        """Fetch and decode every image of a request at once; the first refusal (in prompt
        order) is raised and the other fetches are cancelled."""
        self.check_count(images)
        if not images:
            return []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._load_one(im)) for im in images]
        except BaseExceptionGroup as group:
            refusals = [e for e in _leaves(group) if isinstance(e, OpenAIError)]
            if not refusals:
                raise
            order = {im.param: i for i, im in enumerate(images)}
            raise min(refusals, key=lambda e: order.get(e.param or "", len(order))) from None
        out = [t.result() for t in tasks]
        if self.metrics is not None:
            for im in images:
                source = "data" if im.url[:5].lower() == "data:" else "url"
                self.metrics.images_received.labels(source).inc()
        return out

    async def store(self, client: aioredis.Redis, images: list[LoadedImage]) -> None:
        """Put each distinct image's bytes under ``media_key(hash)`` for ``ttl_s``; an image
        already there only has its TTL renewed (its bytes are not sent again)."""
        unique = {im.hash: im for im in images}
        if not unique:
            return
        ttl = self.limits.ttl_s
        try:
            async with client.pipeline(transaction=False) as pipe:
                for h in unique:
                    pipe.expire(media_key(h), ttl)
                renewed = await pipe.execute()
            missing = [im for im, ok in zip(unique.values(), renewed, strict=True) if not ok]
            if missing:
                async with client.pipeline(transaction=False) as pipe:
                    for im in missing:
                        pipe.set(media_key(im.hash), im.data, ex=ttl)
                    await pipe.execute()
        except (RedisError, OSError) as e:
            raise redis_unavailable(e, "Redis did not take the request's images") from e

    # ----------------------------------------------------------------------------------
    async def _load_one(self, im: ImageInput) -> LoadedImage:
        # base64 and Pillow are CPU work: in a thread, off the loop that relays tokens
        if im.url[:5].lower() == "data:":
            return await asyncio.to_thread(lambda: self._decode(self._data_url(im), im.param))
        started = time.perf_counter()
        try:
            data = await self._fetch(im)
        finally:  # every fetch, refused or not: a slow image host shows here
            if self.metrics is not None:
                self.metrics.image_fetch_seconds.observe(time.perf_counter() - started)
        return await asyncio.to_thread(self._decode, data, im.param)

    def _data_url(self, im: ImageInput) -> bytes:
        head, sep, body = im.url[5:].partition(",")
        if not sep:
            raise self._refuse("malformed data URL (no comma)", im.param, "invalid_image")
        media_type, *params = head.split(";")
        media_type = media_type.strip().lower()
        if not media_type.startswith("image/") or media_type == "image/svg+xml":
            raise self._refuse(
                f"unsupported image type {media_type or 'text/plain'!r} in a data URL; "
                f"send {_formats()}",
                im.param,
                "unsupported_image_type",
            )
        if "base64" not in (p.strip().lower() for p in params):
            raise self._refuse("data URLs must be base64-encoded (data:image/png;base64,...)",
                               im.param, "invalid_image")  # fmt: skip
        body = "".join(body.split())  # clients may wrap long base64 lines
        if len(body) // 4 * 3 > self.limits.max_bytes + 2:
            raise self._too_many_bytes(im.param)
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise self._refuse("the data URL is not valid base64", im.param,
                               "invalid_image") from None  # fmt: skip
        if len(data) > self.limits.max_bytes:
            raise self._too_many_bytes(im.param)
        return data

    async def _fetch(self, im: ImageInput) -> bytes:
        url = im.url
        try:
            async with asyncio.timeout(self.limits.fetch_timeout_s):
                for _ in range(MAX_REDIRECTS + 1):
                    target, host_header = self._check_url(url, im.param)
                    headers = [(b"Host", host_header), (b"Accept", b"image/*"),
                               (b"Accept-Encoding", b"identity"),
                               (b"User-Agent", b"conveyor-media")]  # fmt: skip
                    async with self._pool.stream("GET", target, headers=headers) as resp:
                        if resp.status in _REDIRECT_STATUSES:
                            location = _header(resp.headers, b"location")
                            if not location:
                                raise self._refuse(f"HTTP {resp.status} without a Location",
                                                   im.param, "image_fetch_failed")  # fmt: skip
                            url = urljoin(url, location)
                            continue
                        if resp.status != 200:
                            raise self._refuse(f"fetching the image failed: HTTP {resp.status}",
                                               im.param, "image_fetch_failed")  # fmt: skip
                        return await self._read_body(resp, im.param)
                raise self._refuse(f"more than {MAX_REDIRECTS} redirects", im.param,
                                   "image_fetch_failed")  # fmt: skip
        except TimeoutError:
            raise self._refuse(
                f"fetching the image took longer than {self.limits.fetch_timeout_s:g} s "
                "(CONVEYOR_MEDIA_FETCH_TIMEOUT_S)",
                im.param,
                "image_fetch_timeout",
            ) from None
        except ForbiddenAddress as e:
            where = f"address {e.address} is" if e.host == e.address else \
                f"host {e.host!r} resolves to {e.address},"  # fmt: skip
            raise self._refuse(
                f"the image URL's {where} a {e.why} address; only public addresses may be "
                "fetched (CONVEYOR_MEDIA_ALLOW_INTERNAL)",
                im.param,
                "image_url_forbidden",
            ) from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException,
                OSError, ssl.SSLError) as e:  # fmt: skip
            raise self._refuse(f"fetching the image failed: {_describe(e)}", im.param,
                               "image_fetch_failed") from None  # fmt: skip

    def _check_url(self, url: str, param: str) -> tuple[httpcore.URL, bytes]:
        """The URL httpcore should request, and its Host header; or a refusal."""
        try:
            parts = urlsplit(url)
            port = parts.port
            host = parts.hostname or ""
            host_ascii = host.encode("idna") if not _is_ip(host) else host.encode()
        except (ValueError, UnicodeError):
            raise self._refuse("malformed image URL", param, "invalid_image") from None
        scheme = parts.scheme.lower()
        allowed = ("https", "http") if self.limits.allow_http else ("https",)
        if scheme not in allowed:
            if scheme == "http":
                why = "http:// image URLs are refused (CONVEYOR_MEDIA_ALLOW_HTTP=true allows them)"
            else:
                why = f"{scheme or 'relative'} URL: only https:// and data: image URLs are accepted"
            raise self._refuse(why, param, "image_url_forbidden")
        if not host_ascii:
            raise self._refuse("the image URL has no host", param, "invalid_image")
        target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
        if parts.query:
            target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
        shown = b"[" + host_ascii + b"]" if b":" in host_ascii else host_ascii
        host_header = shown + (f":{port}".encode() if port else b"")
        return httpcore.URL(scheme=scheme.encode(), host=host_ascii, port=port,
                            target=target.encode()), host_header  # fmt: skip

    async def _read_body(self, resp: httpcore.Response, param: str) -> bytes:
        ctype = (_header(resp.headers, b"content-type") or "").split(";")[0].strip().lower()
        if ctype and not _image_content_type(ctype):
            raise self._refuse(f"the URL served {ctype!r}, not an image; send {_formats()}",
                               param, "unsupported_image_type")  # fmt: skip
        length = _header(resp.headers, b"content-length")
        if length and length.isdigit() and int(length) > self.limits.max_bytes:
            raise self._too_many_bytes(param)
        chunks, size = [], 0
        async for chunk in resp.aiter_stream():
            size += len(chunk)
            if size > self.limits.max_bytes:  # stop reading: the connection is dropped
                raise self._too_many_bytes(param)
            chunks.append(chunk)
        return b"".join(chunks)

    def _decode(self, data: bytes, param: str) -> LoadedImage:
        """Open, verify and load with Pillow (in a thread: this is CPU work)."""
        try:
            # Pillow's own bomb check raises in open() past twice Image.MAX_IMAGE_PIXELS;
            # ours (the limit, from the header) comes before anything is decoded
            with Image.open(BytesIO(data), formats=ALLOWED_FORMATS) as im:
                fmt, (w, h) = im.format, im.size
                self._check_pixels(w, h, param)
                im.verify()  # structure and checksums, without decoding
            with Image.open(BytesIO(data), formats=ALLOWED_FORMATS) as im:
                im.load()  # the pixels (a GIF's first frame): corrupt bodies fail here
                digest = image_hash(im)
        except OpenAIError:
            raise
        except Image.DecompressionBombError:
            raise self._refuse(
                f"the image declares more pixels than the limit of "
                f"{self.limits.max_pixels} (a decompression bomb?)",
                param,
                "image_too_large",
            ) from None
        except UnidentifiedImageError:
            other = _sniff(data)
            if other:
                raise self._refuse(f"unsupported image type {other}; send {_formats()}",
                                   param, "unsupported_image_type") from None  # fmt: skip
            raise self._refuse(f"the image could not be decoded as {_formats()}", param,
                               "invalid_image") from None  # fmt: skip
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as e:
            raise self._refuse(f"the image is corrupt or truncated ({e})", param,
                               "invalid_image") from None  # fmt: skip
        assert fmt in ALLOWED_FORMATS, f"Pillow opened {fmt} despite formats={ALLOWED_FORMATS}"
        return LoadedImage(data, digest, w, h, fmt)

    def _check_pixels(self, w: int, h: int, param: str) -> None:
        if w * h > self.limits.max_pixels:
            raise self._refuse(
                f"the image is {w}x{h} = {w * h} pixels, more than the limit of "
                f"{self.limits.max_pixels} (CONVEYOR_MEDIA_MAX_PIXELS)",
                param,
                "image_too_large",
            )
        bomb = Image.MAX_IMAGE_PIXELS  # Pillow only warns between this and twice it
        if bomb is not None and w * h > bomb:
            raise self._refuse(
                f"the image is {w}x{h} = {w * h} pixels, more than Pillow's decompression-"
                f"bomb limit of {bomb} pixels",
                param,
                "image_too_large",
            )

    def _too_many_bytes(self, param: str) -> OpenAIError:
        return self._refuse(
            f"the image is larger than the limit of {self.limits.max_bytes} bytes "
            "(CONVEYOR_MEDIA_MAX_BYTES)",
            param,
            "image_too_large",
        )

    def _refuse(self, message: str, param: str, code: str) -> OpenAIError:
        assert code in REFUSALS, f"unknown refusal reason {code!r}"
        if self.metrics is not None:
            self.metrics.image_refusals.labels(code).inc()
        return bad_request(message, param, code)


# ======================================================================================
# Addresses: resolve once, check every answer, connect to a checked one
# ======================================================================================
class ForbiddenAddress(Exception):
    def __init__(self, host: str, address: str, why: str) -> None:
        super().__init__(f"{host} -> {address} ({why})")
        self.host, self.address, self.why = host, address, why


def forbidden_reason(address: str) -> str | None:
    """Why ``address`` may not be fetched from (``loopback``, ``private``, ...), or None.
    An IPv6 address that embeds an IPv4 one (mapped, 6to4, NAT64) is judged by both."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # without an IPv6 zone id
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    if isinstance(ip, ipaddress.IPv6Address):  # the embedded address first: it names why
        embedded = [ip.ipv4_mapped, ip.sixtofour]
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        candidates += [e for e in embedded if e is not None]
    candidates.append(ip)
    for c in candidates:
        for attr, why in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"),
                          ("is_link_local", "link-local"), ("is_multicast", "multicast"),
                          ("is_reserved", "reserved"), ("is_private", "private")):  # fmt: skip
            if getattr(c, attr):
                return why
        if not c.is_global:
            return "non-public"
    return None


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the address check in front of every connect: the
    host is resolved once here, every address checked, and a checked address is what the
    socket connects to (httpcore still sends the host name as SNI and in Host)."""

    def __init__(self, resolve: Resolver, allow_internal: bool) -> None:
        self._resolve = resolve
        self._allow_internal = allow_internal
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,
        local_address: str | None = None, socket_options: object = None,
    ) -> httpcore.AsyncNetworkStream:  # fmt: skip
        try:
            addresses = await self._resolve(host, port)
        except OSError as e:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {e}") from e
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} resolves to no address")
        if not self._allow_internal:
            for a in addresses:
                why = forbidden_reason(a)
                if why is not None:
                    raise ForbiddenAddress(host, a, why)
        last: Exception | None = None
        for a in addresses:
            try:
                return await self._inner.connect_tcp(a, port, timeout, local_address,
                                                     socket_options)  # type: ignore[arg-type]  # fmt: skip
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        assert last is not None, "no address tried"
        raise last

    async def connect_unix_socket(
        self, *args: object, **kwargs: object
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("image URLs cannot name a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))  # in order, no repeats


# ======================================================================================
# Helpers
# ======================================================================================
def image_hash(im: Image.Image) -> str:
    """sha256 hex of a decoded image's pixels as the model sees them: RGB, transparency
    composited onto white (as transformers' ``convert_to_rgb`` does), with its size. The
    same picture hashes alike whether it came as PNG or WEBP, in a data URL or over https."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, rgba).convert("RGB")
    else:
        rgb = im.convert("RGB")
    h = hashlib.sha256(f"RGB {rgb.size[0]}x{rgb.size[1]}\n".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def _formats() -> str:
    return ", ".join(ALLOWED_FORMATS[:-1]) + " or " + ALLOWED_FORMATS[-1]


def _image_content_type(ctype: str) -> bool:
    """Whether a Content-Type may carry an image Pillow decodes (servers often send
    octet-stream); what it really is, Pillow decides."""
    if ctype in ("application/octet-stream", "binary/octet-stream"):
        return True
    return ctype.startswith("image/") and ctype != "image/svg+xml"


def _sniff(data: bytes) -> str | None:
    """Name a well-known type Pillow is not allowed to open here, for the message."""
    head = data[:512].lstrip().lower()
    for magic, name in ((b"<svg", "SVG"), (b"<?xml", "SVG/XML"), (b"<!doctype html", "HTML"),
                        (b"<html", "HTML"), (b"%pdf", "PDF"), (b"ii*\x00", "TIFF"),
                        (b"mm\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO")):  # fmt: skip
        if head.startswith(magic):
            return name
    if data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
        return "AVIF/HEIF"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out
