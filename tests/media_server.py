"""A local image server for the media guard's tests: real HTTP(S) on a loopback port.

Routes (GET):
    /img/<name>         an image from ``files`` with its content type
    /slow?s=S           answers after S seconds
    /endless            an image/png body that never ends (chunked, no length)
    /declared-big       Content-Length far over any limit, then a little body
    /redirect?to=URL    302 to URL
    /loop               302 to itself
    /barrier            waits until ``barrier_parties`` requests are in it at once (or
                        5 s: then 500), for checking that fetches run concurrently
Every request's path and Host header are recorded in ``seen``.
"""

from __future__ import annotations

import http.server
import io
import shutil
import ssl
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from PIL import Image


def encode(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def picture(w: int = 40, h: int = 30, seed: int = 0) -> Image.Image:
    """A small RGB picture with structure (different seeds: different pixels)."""
    im = Image.new("RGB", (w, h))
    im.putdata([((x * 7 + seed) % 256, (y * 11 + seed) % 256, (x * y + seed) % 256)
                for y in range(h) for x in range(w)])  # fmt: skip
    return im


def png_bomb(side: int) -> bytes:
    """A valid 1-bit grayscale PNG of side x side pixels, all black: a few KB that decode
    to side**2 pixels (a decompression bomb for a large side)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    ihdr = side.to_bytes(4, "big") * 2 + bytes([1, 0, 0, 0, 0])  # depth 1, grayscale
    z = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte 0 + the row's bits
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def make_cert(d: Path) -> tuple[Path, Path] | None:
    """A self-signed certificate for ``localhost`` / 127.0.0.1 (cert, key), or None without
    an ``openssl`` binary."""
    exe = shutil.which("openssl")
    if exe is None:
        return None
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run([exe, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    return cert, key


class ImageServer:
    def __init__(self, files: dict[str, tuple[bytes, str]], barrier_parties: int = 2) -> None:
        self.files = files
        self.seen: list[tuple[str, str]] = []  # (path, Host header)
        self.peers: set[tuple[str, int]] = set()  # client sockets (keep-alive reuse)
        self.barrier = threading.Barrier(barrier_parties)
        self.port = 0
        self.scheme = "http"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    @contextmanager
    def running(self, tls: tuple[Path, Path] | None = None) -> Iterator[ImageServer]:
        server = _QuietServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
            self.scheme = "https"
        self.port = server.server_address[1]
        t = threading.Thread(target=server.serve_forever, daemon=True)
        t.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up mid-body (as the guard does at a limit) is expected


def _handler(srv: ImageServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real image hosts do

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", ctype: str = "text/plain",
                  extra: dict[str, str] | None = None) -> None:  # fmt: skip
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            srv.seen.append((self.path, self.headers.get("Host", "")))
            srv.peers.add(self.client_address[:2])
            u = urlsplit(self.path)
            q = {k: v[0] for k, v in parse_qs(u.query).items()}
            if u.path.startswith("/img/"):
                name = u.path[len("/img/") :]
                if name not in srv.files:
                    return self._send(404, b"no such image")
                body, ctype = srv.files[name]
                return self._send(200, body, ctype)
            if u.path == "/slow":
                time.sleep(float(q.get("s", "2")))
                body, ctype = next(iter(srv.files.values()))
                return self._send(200, body, ctype)
            if u.path == "/endless":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"\x00" * 65536
                try:
                    for _ in range(100_000):  # ~6.5 GB: only a client that stops ends it
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                except OSError:
                    pass  # the client hung up: what the guard should do
                return None
            if u.path == "/declared-big":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(10**10))
                self.end_headers()
                self.wfile.write(b"\x89PNG")
                return None
            if u.path == "/redirect":
                return self._send(302, extra={"Location": q["to"]})
            if u.path == "/loop":
                return self._send(302, extra={"Location": "/loop"})
            if u.path == "/barrier":
                try:
                    srv.barrier.wait(timeout=5)
                except threading.BrokenBarrierError:
                    return self._send(500, b"the other fetch never came")
                body, ctype = next(iter(srv.files.values()))
                return self._send(200, body, ctype)
            return self._send(404, b"not found")

    return Handler
