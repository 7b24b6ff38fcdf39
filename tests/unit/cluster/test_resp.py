"""cluster.resp: hiredis' packer and the Python encoder write the same bytes, exact RESP, and
refuse the same arguments; a command built from its head and a bulk is the whole command."""

from __future__ import annotations

import pytest

from cluster import resp

COMMANDS = [
    ("SET", "k", b"v\r\n"),
    ("SELECT", 3),
    ("EVALSHA", "a" * 40, 2, "load:generate", "é", -7, 0.5, 10**20, memoryview(b"mv"), b""),
]


def test_encode_is_resp_arrays_of_bulk_strings() -> None:
    assert resp.encode(COMMANDS[:2]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"
    )


def test_hiredis_and_the_fallback_write_the_same_bytes() -> None:
    assert resp._pack is not None, "redis[hiredis] is a dependency: hiredis packs commands"
    packed = resp.encode(COMMANDS)
    assert packed == resp._encode_py(COMMANDS)
    assert b"$2\r\n\xc3\xa9\r\n$2\r\n-7\r\n$3\r\n0.5\r\n$21\r\n100000000000000000000\r\n" in packed
    assert packed.endswith(b"$2\r\nmv\r\n$0\r\n\r\n")
    assert resp.encode([["GET", "k"]]) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"  # a list too


@pytest.mark.parametrize("bad", [True, None, 1j, bytearray(b"x")])
def test_both_refuse_what_redis_py_refuses(bad: object) -> None:
    with pytest.raises(TypeError):
        resp.encode([("SET", "k", bad)])
    with pytest.raises(TypeError):
        resp._encode_py([("SET", "k", bad)])


def test_a_head_and_a_bulk_make_the_whole_command() -> None:
    head = resp.command_head(3, "PUBLISH", "tokens:r1")
    assert head + resp.bulk(b'{"s":0}') == resp.encode([("PUBLISH", "tokens:r1", b'{"s":0}')])
    assert resp.command_head(2) == b"*2\r\n"
