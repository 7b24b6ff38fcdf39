"""api.resp.RespConnection against a real redis-server: commands leave before the caller's
next await, replies match their commands, and errors, drops and password-protected
servers behave."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from api.resp import RespConnection, encode
from tests.integration.conftest import redis_db, start_redis


def test_encode_is_resp_arrays_of_bulk_strings() -> None:
    assert encode([("SET", "k", b"v\r\n"), ("SELECT", 3)]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"
    )


def test_send_writes_before_the_next_await_and_replies_match(redis_url: str) -> None:
    url = redis_db(redis_url, 11)
    r = redis.Redis.from_url(url)
    r.flushdb()
    order: list[str] = []

    async def main() -> None:
        conn = RespConnection(url)
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
        conn.close()

    asyncio.run(main())
    assert order[0] == "sent"  # the sends did not wait for the loop's next turn
    assert r.llen("l") == 50
    r.flushdb()


def test_a_dropped_connection_fails_its_waiters_and_reconnects(redis_url: str) -> None:
    url = redis_db(redis_url, 11)

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


def test_only_redis_urls() -> None:
    with pytest.raises(ValueError):
        RespConnection("rediss://127.0.0.1:6379/0")
