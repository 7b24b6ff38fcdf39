"""The suite's database allocator (conftest.RedisDbs): every deployment a database of its
own, flushed, none handed out twice, and a database used without it is found."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.integration.conftest import RedisDbs, start_redis

pytestmark = pytest.mark.integration


def test_each_take_is_a_new_flushed_database_and_strays_are_found(tmp_path: Path) -> None:
    proc, url = start_redis(tmp_path, "--databases", "4")
    try:
        base = url.rsplit("/", 1)[0]
        redis.Redis.from_url(f"{base}/1").set("left", "over")  # a previous run's key
        dbs = RedisDbs(url)
        taken = [dbs.take("a"), dbs.take("b")]
        assert taken == [f"{base}/1", f"{base}/2"]
        assert redis.Redis.from_url(taken[0]).dbsize() == 0
        assert dbs.owners == {0: "the session cluster", 1: "a", 2: "b"}
        assert dbs.strays() == []
        redis.Redis.from_url(f"{base}/3").set("picked", "by hand")
        assert dbs.strays() == [3]
        dbs.take("c")  # the last of the 4 (and db 3 is no stray once handed out)
        assert dbs.strays() == []
        with pytest.raises(AssertionError, match="all 4 databases"):
            dbs.take("d")
    finally:
        proc.stop()
