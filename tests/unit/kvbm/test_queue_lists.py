"""kvbm.protocol.queue_lists names the lists kombu's Redis transport keeps a queue in."""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from kvbm.protocol import QUEUE_PRIORITY_SEP, QUEUE_PRIORITY_STEPS, queue_lists


def test_queue_lists_match_kombus_redis_channel() -> None:
    ch = kombu_redis.Channel
    assert QUEUE_PRIORITY_SEP == ch.sep
    assert list(QUEUE_PRIORITY_STEPS) == list(ch.priority_steps)
    # kombu's own naming of each priority's list (Channel._q_for_pri, on a bare channel)
    bare = object.__new__(ch)
    bare.priority_steps, bare.sep = ch.priority_steps, ch.sep
    assert queue_lists("decode.w1") == [
        ch._q_for_pri(bare, "decode.w1", p) for p in ch.priority_steps
    ]
    assert queue_lists("decode.w1")[0] == "decode.w1"
