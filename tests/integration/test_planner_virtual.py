"""The virtual connector on a real redis-server: each decision replaces the pool's decision
hash (no TTL), an outside orchestrator acknowledges it by id (``ack_decision``, what
``conveyor planner-ack`` runs), and only an acknowledgement of the current decision
settles it."""

from __future__ import annotations

import logging

import pytest
import redis

from cluster.keys import planner_decision_key
from planner.connectors import ConnectorError, Decision, VirtualConnector, ack_decision

pytestmark = pytest.mark.integration


def test_decision_hash_ack_and_settled(fresh_db: str, caplog: pytest.LogCaptureFixture) -> None:
    client = redis.Redis.from_url(fresh_db, decode_responses=True)
    c = VirtualConnector(redis.Redis.from_url(fresh_db))  # bytes replies, as the planner's
    first = Decision(pool="decode", replicas=3, previous=2, reason="load: all 2 over ITL")
    c.scale(first)
    key = planner_decision_key("decode")
    assert client.hgetall(key) == {
        "id": first.id, "pool": "decode", "replicas": "3", "previous": "2",
        "reason": "load: all 2 over ITL", "ts": str(first.ts),
    }  # fmt: skip
    assert client.ttl(key) == -1  # kept until the next decision
    assert not c.settled(first) and c.replicas("decode") is None

    with pytest.raises(ConnectorError, match="no decision nope .*current: " + first.id):
        ack_decision(client, "decode", "nope")
    with pytest.raises(ConnectorError, match="current: none"):
        ack_decision(client, "prefill", first.id)
    assert not c.settled(first)
    ack_decision(client, "decode", first.id)
    assert c.settled(first) and c.replicas("decode") == 3

    # the next decision drops the previous ack; an error acknowledges it all the same
    second = Decision(pool="decode", replicas=2, previous=3, reason="under SLA x 0.8")
    c.scale(second)
    assert "ack" not in client.hgetall(key) and not c.settled(second)
    with pytest.raises(ConnectorError):
        ack_decision(client, "decode", first.id)  # too late: it was replaced
    ack_decision(client, "decode", second.id, error="quota exceeded")
    with caplog.at_level(logging.WARNING, logger="planner.connectors"):
        assert c.settled(second) and c.settled(second)
    assert [r.getMessage().count("quota exceeded") for r in caplog.records] == [1]  # once
    assert c.replicas("decode") is None  # it failed: the planner counts live members
    ack_decision(client, "decode", second.id)  # a retry that worked clears the error
    assert "error" not in client.hgetall(key) and c.replicas("decode") == 2
