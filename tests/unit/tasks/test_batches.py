"""tasks.batches' input checks and tasks.files' directory store (no Redis, no Celery)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.batches import InvalidInput, new_batch, parse_input, with_counts
from tasks.files import DirFileStore

CHAT = "/v1/chat/completions"


def _line(cid: str, **over: object) -> str:
    line = {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    return json.dumps({**line, **over})


def test_input_lines_are_checked_and_the_first_bad_one_named() -> None:
    good = "\n".join([_line("a"), "", _line("b")]).encode()
    assert [x["custom_id"] for x in parse_input(good, CHAT)] == ["a", "b"]
    bad = [
        ("not json", 1, "not JSON"),
        (_line("a") + "\n" + _line("a"), 2, "used twice"),
        (_line("a", url="/v1/completions"), 1, "not the batch's endpoint"),
        (_line("a", method="GET"), 1, "POST"),
        (_line("", body={}), 1, "custom_id"),
        (_line("a", body=[1]), 1, "body"),
    ]
    for text, line, why in bad:
        with pytest.raises(InvalidInput, match=why) as e:
            parse_input(text.encode(), CHAT)
        assert e.value.line == line
    with pytest.raises(InvalidInput, match="no request"):
        parse_input(b"\n\n", CHAT)


def test_a_batch_object_and_its_live_counts() -> None:
    b = new_batch("file-x", CHAT, "24h", 3, {"k": "v"})
    assert b["id"].startswith("batch_") and b["status"] == "in_progress"
    assert b["expires_at"] - b["created_at"] == 24 * 3600
    live = with_counts(b, 2, 1)
    assert live["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    done = {**b, "status": "completed", "request_counts": {"total": 3, "completed": 3,
                                                            "failed": 0}}  # fmt: skip
    assert with_counts(done, 0, 0) == done  # a finished batch keeps its own counts


def test_the_directory_store(tmp_path: Path) -> None:
    store = DirFileStore(tmp_path / "files")
    meta = store.put(b"line\n", "in.jsonl", "batch")
    assert meta["bytes"] == 5 and meta["filename"] == "in.jsonl" and meta["purpose"] == "batch"
    assert store.read(meta["id"]) == b"line\n" and store.meta(meta["id"]) == meta
    other = store.put(b"x", "out.jsonl", "batch_output")
    assert {m["id"] for m in store.list()} == {meta["id"], other["id"]}
    assert [m["id"] for m in store.list("batch")] == [meta["id"]]
    for bad in ("../etc/passwd", "file-" + "z" * 24, "file-abc", meta["id"] + "/x"):
        assert store.read(bad) is None and store.meta(bad) is None and not store.delete(bad)
    assert store.delete(meta["id"]) and store.read(meta["id"]) is None
    assert not list((tmp_path / "files").glob(".*"))  # no temporary file left
