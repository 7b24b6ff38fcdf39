"""cluster.queues names the lists kombu's Redis transport keeps a queue in (kombu is
imported here only: cluster/ depends on redis alone)."""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from cluster.queues import (
    QUEUE_PRIORITY_SEP,
    QUEUE_PRIORITY_STEPS,
    list_suffixes,
    queue_lists,
)


def _kombu_lists(queue: str) -> list[str]:
    """kombu's own naming of each priority's list (Channel._q_for_pri, on a bare channel)."""
    ch = kombu_redis.Channel
    bare = object.__new__(ch)
    bare.priority_steps, bare.sep = ch.priority_steps, ch.sep
    return [ch._q_for_pri(bare, queue, p) for p in ch.priority_steps]


def test_queue_lists_match_kombus_redis_channel() -> None:
    ch = kombu_redis.Channel
    assert QUEUE_PRIORITY_SEP == ch.sep
    assert list(QUEUE_PRIORITY_STEPS) == list(ch.priority_steps)
    assert queue_lists("decode.w1") == _kombu_lists("decode.w1")
    assert queue_lists("decode.w1")[0] == "decode.w1"


def test_script_suffixes_make_kombus_names() -> None:
    # what the prune and depth scripts append to a queue's name, list by list
    assert ["prefill.w7" + s for s in list_suffixes()] == _kombu_lists("prefill.w7")
