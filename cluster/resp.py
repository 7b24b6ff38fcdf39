"""RESP, the Redis protocol, written by hand for the connections that skip redis-py's
client: the API's :class:`api.resp.RespConnection` and the engine's
:class:`workers.stream.FramePublisher`. The one place a command becomes bytes.

:func:`encode` packs whole commands with hiredis' ``pack_command`` (C), else with
:func:`_encode_py`; :func:`command_head` and :func:`bulk` build a command in two parts, for
a caller that keeps a command's head (``PUBLISH <channel>``) and adds its last argument
per use: at one frame per token, a cached head and one :func:`bulk` cost less than packing
the whole command each time (docs/performance.md, "RESP: one encoder").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

try:
    from hiredis import pack_command as _pack  # hiredis >= 2.0
except ImportError:  # redis[hiredis] brings it; the encoder below stands in without
    _pack = None  # type: ignore[assignment]

Command = Sequence[Any]  # str, bytes, memoryview, int or float arguments


def bulk(arg: bytes | str | int | float | memoryview) -> bytes:
    """One bulk string: ``$<len>\\r\\n<bytes>\\r\\n`` (str as UTF-8, numbers as ``repr``)."""
    if type(arg) is bytes:  # a frame: the per-token path
        return b"$%d\r\n%b\r\n" % (len(arg), arg)
    if isinstance(arg, str):
        arg = arg.encode()
    elif isinstance(arg, int | float) and not isinstance(arg, bool):
        arg = repr(arg).encode()
    elif isinstance(arg, memoryview):
        arg = arg.tobytes()
    elif not isinstance(arg, bytes):  # a subclass of bytes passes
        raise TypeError(f"a Redis argument must be str, bytes, int or float, not {arg!r}")
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def command_head(nargs: int, *first: Any) -> bytes:
    """The start of a command of ``nargs`` arguments: its array header and the bulk strings
    of ``first``; the caller appends ``bulk()`` of the ``nargs - len(first)`` others."""
    assert len(first) <= nargs, f"{len(first)} arguments given for a command of {nargs}"
    return b"*%d\r\n" % nargs + b"".join([bulk(a) for a in first])


def _encode_py(commands: Iterable[Command]) -> bytes:
    return b"".join([command_head(len(c), *c) for c in commands])


def encode(commands: Iterable[Command]) -> bytes:
    """RESP arrays of bulk strings, one per command, in order. ``TypeError`` for an
    argument that is not str, bytes, memoryview, int or float (a bool included, as
    redis-py refuses it)."""
    if _pack is None:
        return _encode_py(commands)
    return b"".join([_pack(c if type(c) is tuple else tuple(c)) for c in commands])


def as_str(v: bytes | str) -> str:
    """A reply's string (redis-py gives bytes unless the client decodes)."""
    return v.decode() if isinstance(v, bytes) else v
