"""api.resp.RespConnection against a real redis-server: commands leave before the caller's
next await, replies match their commands, and errors, drops and password-protected
servers behave."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from api.resp import RespConnection
from api.runner import wait_answer
from tests.integration.conftest import free_port, start_redis

pytestmark = pytest.mark.integration


def test_send_writes_before_the_next_await_and_replies_match(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    order: list[str] = []

    async def main() -> None:
        conn = RespConnection(fresh_db)
        await conn.connect()
        loop = asyncio.get_running_loop()
        loop.call_soon(order.append, "another callback")
        futs = [conn.send(("RPUSH", "l", str(i)), ("LLEN", "l")) for i in range(50)]
        order.append("sent")
        replies = await asyncio.gather(*futs)
        assert replies == [[i + 1, i + 1] for i in range(50)]
        # an error reply fails its own send only, and the next ones stay in step
        bad = conn.send(("LPUSH", "s", "x"), ("INCR", "l"))  # INCR on a list: WRONGTYPE
        good = conn.send(("GET", "missing"))
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await bad
        assert await good == [None]
        # a caller that stops waiting does not shift the replies of the next one
        slow = conn.send(("BLPOP", "nothing", "0.2"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slow, 0.05)
        assert await conn.execute(("LLEN", "l")) == [50]
        # nothing to send: answered at once, and the next replies stay in step
        assert await asyncio.wait_for(conn.send(), 1.0) == []
        assert await conn.execute(("LLEN", "l")) == [50]
        conn.close()

    asyncio.run(main())
    assert order[0] == "sent"  # the sends did not wait for the loop's next turn
    assert r.llen("l") == 50
    r.flushdb()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_answer_read_after_a_late_turn_of_the_loop_still_counts(
    fresh_db: str, loop: str
) -> None:
    """The burst case (api.runner.wait_answer): the loop is busy past a send's deadline
    while Redis answers; the next turn runs the deadline's timer before the reply's
    callbacks. The answer counts; a cancelling deadline (``asyncio.timeout``, as the
    runner had) fails the same send, and a broker that does not answer still times out."""

    async def late_turn(naive: bool) -> None:
        ev = asyncio.get_running_loop()
        conn = RespConnection(fresh_db)
        await conn.connect()
        try:
            deadline = ev.time() + 0.1
            fut = conn.send(("PING",))
            time.sleep(0.3)  # the rest of a long turn (other requests): past the deadline
            if naive:
                async with asyncio.timeout_at(deadline):
                    await fut
            else:
                await wait_answer(fut, deadline)
            assert fut.result() == [b"PONG"]
            with pytest.raises(TimeoutError):  # no answer for 0.3 s: a silent broker
                await wait_answer(conn.send(("BLPOP", "nothing", "0.3")), ev.time() + 0.05)
        finally:
            conn.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        run = uvloop.run
    else:
        run = asyncio.run
    run(late_turn(naive=False))
    with pytest.raises(TimeoutError):
        run(late_turn(naive=True))


def test_a_dropped_connection_fails_its_waiters_and_reconnects(own_redis: str) -> None:
    url = own_redis  # it kills every client but its own

    async def main() -> None:
        conn = RespConnection(url)
        await conn.execute(("CLIENT", "SETNAME", "resp-drop"))
        waiting = conn.send(("BLPOP", "never", "5"))
        redis.Redis.from_url(url).client_kill_filter(_type=None, skipme=True)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(waiting, 2)
        assert not conn.connected
        with pytest.raises(RedisConnectionError):
            conn.send(("PING",))  # send never connects: execute and connect do
        assert await conn.execute(("PING",)) == [b"PONG"]
        conn.close()

    asyncio.run(main())


def test_password_and_database_come_from_the_url(tmp_path: Path) -> None:
    proc, url = start_redis(tmp_path, "--requirepass", "s3cret", auth=":s3cret@")
    try:
        url5 = url.rsplit("/", 1)[0] + "/5"

        async def main() -> None:
            conn = RespConnection(url5)
            assert await conn.execute(("SET", "where", "db5")) == [b"OK"]
            conn.close()
            wrong = RespConnection(url5.replace("s3cret", "nope"))
            with pytest.raises(ResponseError):
                await wrong.connect()
            assert not wrong.connected

        asyncio.run(main())
        assert redis.Redis.from_url(url5).get("where") == b"db5"
        assert redis.Redis.from_url(url).get("where") is None  # db 0
    finally:
        proc.stop()


def test_unix_socket_and_tls_urls(tmp_path: Path) -> None:
    """unix:// and rediss:// (a self-signed certificate: verified against it as the CA,
    and not verified with ssl_cert_reqs=none), and a scheme redis-py does not know."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    sock = tmp_path / "redis.sock"
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip
    proc, url = start_redis(tmp_path, "--unixsocket", str(sock), *tls)
    try:
        urls = [f"unix://{sock}?db=3",
                f"rediss://localhost:{tls_port}/3?ssl_ca_certs={cert}",
                f"rediss://127.0.0.1:{tls_port}/3?ssl_cert_reqs=none"]  # fmt: skip

        async def main() -> None:
            for i, u in enumerate(urls):
                conn = RespConnection(u)
                assert await conn.execute(("RPUSH", "schemes", str(i))) == [i + 1], u
                conn.close()
            strict = RespConnection(f"rediss://127.0.0.1:{tls_port}/3")  # not a trusted CA
            with pytest.raises(RedisConnectionError):
                await strict.connect()

        asyncio.run(main())
        assert redis.Redis.from_url(url.rsplit("/", 1)[0] + "/3").llen("schemes") == 3
    finally:
        proc.stop()
    with pytest.raises(ValueError):
        RespConnection("http://127.0.0.1:6379/0")
