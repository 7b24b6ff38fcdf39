"""The frame publisher against a real redis-server: numbering, delivery, reconnection."""

from __future__ import annotations

import json
import socket
import time

import pytest
import redis

from tests.integration.conftest import needs_redis, wait_for
from workers.engine_api import RequestOutput
from workers.stream import DRAIN_AFTER, IDLE_CHECK_S, FramePublisher

pytestmark = pytest.mark.integration


def _next(sub: redis.client.PubSub, timeout: float = 2.0) -> dict | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        msg = sub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            return json.loads(msg["data"])
    return None


def test_frames_are_numbered_delivered_and_survive_a_dropped_connection(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe("tokens:a", "tokens:b")
    published: list[str] = []
    pub = FramePublisher(r, on_published=lambda outs: published.extend(o.text for o in outs))
    try:
        pub.publish_outputs([RequestOutput("a", [1], "x"), RequestOutput("b", [2], "y")])
        pub.publish_outputs([RequestOutput("a", [3], "z", finished=True, finish_reason="stop")])
        frames = [_next(sub) for _ in range(3)]
        by_id = sorted((f["seq"], f["text"], bool(f.get("done"))) for f in frames if f)
        assert by_id == [(0, "x", False), (0, "y", False), (1, "z", True)]
        assert published == ["x", "y", "z"] and pub.frames_published == 3

        # The server drops the publisher's connection. The next write still goes out (the
        # kernel takes it; the server answers it with a reset), so its frame is lost
        # unseen; the write after it fails: counted, its frame dropped. The third one
        # reconnects and arrives, numbered after the lost ones (the API sees the gap).
        ids: list[object] = []
        pub.send_command(("CLIENT", "ID"), ids.append)
        assert pub.wait_replies(2.0) and isinstance(ids[0], int)
        r.client_kill_filter(_id=ids[0])
        got = []
        for i in range(3):
            pub.publish_outputs([RequestOutput("b", [10 + i], f"t{i}")])
            got.append(_next(sub, 0.5))
        assert got[:2] == [None, None]
        assert got[2] is not None and (got[2]["seq"], got[2]["text"]) == (3, "t2")
        assert pub.publish_errors == 1
        assert pub.frames_published == 5  # t0's write went out: the loss is unseen here
        assert published == ["x", "y", "z", "t0", "t1", "t2"]  # each write's outputs handed on
    finally:
        pub.stop()
        sub.close()


def test_a_connection_closed_while_idle_loses_no_frame(fresh_db: str) -> None:
    """Redis closes the connection while no frame flows (a restart of Redis): the socket
    would take the next write without an error and lose it. After IDLE_CHECK_S of silence
    the publisher notices first and writes the very next frame on a new connection."""
    r = redis.Redis.from_url(fresh_db)
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe("tokens:idle")
    pub = FramePublisher(r)
    try:
        ids: list[object] = []
        pub.send_command(("CLIENT", "ID"), ids.append)
        assert pub.wait_replies(2.0) and isinstance(ids[0], int)
        r.client_kill_filter(_id=ids[0])
        time.sleep(IDLE_CHECK_S + 0.2)  # the silence itself is what the publisher must notice
        pub.publish_outputs([RequestOutput("idle", [1], "first")])
        got = _next(sub)
        assert got is not None and (got["seq"], got["text"]) == (0, "first")
        assert pub.wait_replies(2.0) and pub.publish_errors == 0
    finally:
        pub.stop()
        sub.close()


def test_a_publish_never_waits_for_replies(own_redis: str) -> None:
    """The engine thread writes a step's frames and goes on: replies that have not come
    yet are read on a later write, never waited for (Redis paused: no reply comes)."""
    r = redis.Redis.from_url(own_redis)  # it pauses every client
    pub = FramePublisher(r)
    try:
        pub.publish_outputs([RequestOutput("c", [1], "x")])  # connected, answered
        assert pub.wait_replies(2.0)
        r.execute_command("CLIENT", "PAUSE", 600, "ALL")  # Redis answers nobody for 0.6 s
        t = time.monotonic()
        for i in range(5):
            pub.publish_outputs([RequestOutput("c", [2 + i], "y")])
        assert time.monotonic() - t < 0.3
        assert not pub.wait_replies(0.05)  # still owed
        assert pub.wait_replies(3.0)  # and read once Redis answers again
        assert pub.publish_errors == 0 and pub.frames_published == 6
    finally:
        pub.stop()


def test_replies_are_read_in_batches_not_after_every_write(fresh_db: str) -> None:
    """Looking for replies costs the engine thread system calls: a write reads those that
    have come only once DRAIN_AFTER are owed, and then all of them."""
    r = redis.Redis.from_url(fresh_db)
    pub = FramePublisher(r)
    got: list[object] = []
    try:
        pub.send_command(("PING",), got.append)
        for i in range(DRAIN_AFTER - 2):
            pub.publish_outputs([RequestOutput("d", [i], "x")])
        assert pub.quiet  # one reply owed per step
        wait_for(lambda: _replies_waiting(pub) == DRAIN_AFTER - 1, 5, "every reply to come")
        assert got == [] and len(pub._owed) == DRAIN_AFTER - 1  # none was read
        pub.publish_outputs([RequestOutput("d", [99], "y")])  # the DRAIN_AFTER-th
        assert got == [b"PONG"] and len(pub._owed) <= 1
        assert pub.wait_replies(2.0) and pub.publish_errors == 0
    finally:
        pub.stop()


def _replies_waiting(pub: FramePublisher) -> int:
    """The replies come and unread on the publisher's socket (one line each: +PONG, +OK)."""
    sock = pub._conn._sock  # type: ignore[attr-defined]
    return sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT).count(b"\r\n")


def _calls(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_step_owes_one_reply_where_the_server_takes_client_reply(own_redis: str) -> None:
    """A step's PUBLISH commands go between CLIENT REPLY OFF and ON: the frames all arrive,
    and the publisher reads one reply per step instead of one per frame."""
    r = redis.Redis.from_url(own_redis)  # server-wide command counts
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(*(f"tokens:q{i}" for i in range(8)))
    pub = FramePublisher(r)
    try:
        before = _calls(r, "client|reply")
        for step in range(3):
            pub.publish_outputs([RequestOutput(f"q{i}", [i], f"{step}") for i in range(8)])
        assert pub.quiet
        assert pub.wait_replies(2.0)
        frames = [_next(sub) for _ in range(24)]
        assert sorted((f["seq"], f["text"]) for f in frames if f) == sorted(
            (s, str(s)) for s in range(3) for _ in range(8)
        )
        # the probe on connecting (ON) and OFF + ON for each of the 3 steps
        assert _calls(r, "client|reply") - before == 7
        # a step of one frame owes one reply either way: it goes without OFF and ON
        pub.publish_outputs([RequestOutput("q0", [9], "one")])
        assert pub.wait_replies(2.0)
        assert (_next(sub) or {}).get("text") == "one"
        assert _calls(r, "client|reply") - before == 7
        assert pub.publish_errors == 0 and pub.frames_published == 25
    finally:
        pub.stop()
        sub.close()


def test_a_server_that_refuses_client_reply_gets_frames_read_one_by_one(own_redis: str) -> None:
    """A server (or proxy, or an ACL) that refuses CLIENT REPLY: every PUBLISH is answered
    and read, and the frames still arrive in order."""
    needs_redis(own_redis, 7, "an ACL rule that denies one subcommand: -client|reply")
    admin = redis.Redis.from_url(own_redis)  # server-wide: an ACL user, command counts
    admin.acl_setuser("noreply", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-client|reply"])  # fmt: skip
    kw = admin.connection_pool.connection_kwargs
    r = redis.Redis(host=kw["host"], port=kw["port"], db=8, username="noreply", password="pw")
    sub = admin.pubsub(ignore_subscribe_messages=True)
    sub.subscribe("tokens:n")
    pub = FramePublisher(r)
    try:
        for i in range(4):
            pub.publish_outputs([RequestOutput("n", [i], f"t{i}")])
        assert not pub.quiet
        assert pub.wait_replies(2.0)
        texts = [(f or {}).get("text") for f in (_next(sub) for _ in range(4))]
        assert texts == ["t0", "t1", "t2", "t3"]
        assert pub.publish_errors == 0 and pub.frames_published == 4
    finally:
        pub.stop()
        sub.close()
        admin.acl_deluser("noreply")
