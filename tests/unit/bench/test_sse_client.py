"""bench/sse_client.py against a scripted HTTP server on a real loopback socket."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from sse_client import SSEClient, StreamError, run_loop  # noqa: E402

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\r\n\r\n"


class ScriptedServer:
    """Answers each request read on a connection with the next script: a list of byte
    strings written with a pause between them (so the client sees them split), then
    ``close`` or not."""

    def __init__(self, scripts: list[tuple[list[bytes], bool]]) -> None:
        self.scripts = list(scripts)
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.scripts:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)  # fmt: skip
            self.requests.append(head + await reader.readexactly(length))
            parts, close = self.scripts.pop(0)
            for p in parts:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0.005)
            if close:
                break
        writer.close()


async def serve(scripts: list[tuple[list[bytes], bool]], body: dict, n: int = 1):  # type: ignore[no-untyped-def]
    srv = ScriptedServer(scripts)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    results: list[object] = []
    try:
        async with SSEClient(f"http://127.0.0.1:{port}", 4, 5.0) as client:
            for _ in range(n):
                try:
                    results.append(await client.stream("/v1/completions", body))
                except StreamError as e:
                    results.append(e)
    finally:
        server.close()
    return srv, results


def test_split_chunks_and_events_reach_the_caller_whole_on_one_kept_alive_connection() -> None:
    one, two = {"choices": [{"text": "é"}]}, {"choices": [{"text": "b"}], "usage": {"n": 2}}
    stream = chunk(event(one)) + chunk(event(two)) + chunk(event(b"[DONE]")) + b"0\r\n\r\n"
    # split inside the chunk-size line, inside a data line and inside the CRLF pair
    cuts = [3, len(SSE_HEAD) + 2, len(SSE_HEAD) + 15, len(SSE_HEAD) + 40, len(stream) - 3]
    raw = SSE_HEAD + stream
    parts = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    srv, results = run_loop(serve([(parts, False), ([raw], False)], {"stream": True}, n=2))
    for got in results:
        assert isinstance(got, list)
        assert [obj for _, obj in got] == [one, two]
        assert got[0][0] <= got[1][0]
    first = results[0]
    assert isinstance(first, list) and first[1][0] > first[0][0]  # stamped on arrival
    assert srv.connections == 1  # the second request reused the first connection
    assert all(r.startswith(b"POST /v1/completions HTTP/1.1\r\n") for r in srv.requests)
    assert json.loads(srv.requests[0].split(b"\r\n\r\n", 1)[1]) == {"stream": True}


def test_an_error_status_raises_with_the_servers_message() -> None:
    body = json.dumps({"error": {"message": "max_tokens is too large", "type": "x"}}).encode()
    resp = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    _, [err] = run_loop(serve([([resp], False)], {}))
    assert isinstance(err, StreamError) and str(err) == "HTTP 400: max_tokens is too large"


def test_an_error_event_raises_it() -> None:
    raw = SSE_HEAD + chunk(event({"error": {"message": "worker lost"}})) + b"0\r\n\r\n"
    _, [err] = run_loop(serve([([raw], False)], {}))
    assert isinstance(err, StreamError) and "worker lost" in str(err)


@pytest.mark.parametrize("ending", [b"0\r\n\r\n", b""], ids=["no-done", "closed-mid-body"])
def test_a_stream_without_done_raises_and_the_next_request_gets_a_new_connection(
    ending: bytes,
) -> None:
    # no-done: the response is whole and the server then closes the connection unasked,
    # as an idle keep-alive timeout does: the next request, sent on it, goes again on a
    # new connection. closed-mid-body: the client sees the close before it is done.
    raw = SSE_HEAD + chunk(event({"choices": []})) + ending
    good = SSE_HEAD + chunk(event(b"[DONE]")) + b"0\r\n\r\n"
    srv, (err, ok) = run_loop(serve([([raw], True), ([good], False)], {}, n=2))
    assert isinstance(err, StreamError)
    assert ok == [] and srv.connections == 2
    assert len(srv.requests) == 2  # nothing was answered twice


def test_a_connection_close_response_is_not_reused() -> None:
    raw = SSE_HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n") + chunk(
        event(b"[DONE]")) + b"0\r\n\r\n"  # fmt: skip
    srv, results = run_loop(serve([([raw], True), ([raw], True)], {}, n=2))
    assert results == [[], []] and srv.connections == 2


def test_get_json_reads_a_plain_body() -> None:
    async def main() -> object:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"data": [{"id": "m"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with SSEClient(f"http://127.0.0.1:{port}", 1, 5.0) as client:
            got = await client.get_json("/v1/models")
        server.close()
        return got

    assert run_loop(main()) == {"data": [{"id": "m"}]}


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="plain http"):
        SSEClient("https://example.com", 1, 1.0)
