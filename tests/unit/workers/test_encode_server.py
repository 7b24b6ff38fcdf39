"""The encode worker's batching and aborts (workers/encode_server.py), without a model:
which waiting requests go through the tower together, and what an abort drops."""

from __future__ import annotations

import threading
from collections import deque

from kvbm.protocol import ImageRef, Sampling, StagePayload
from workers.encode_server import EncodeServer
from workers.engine_ipc import Abort, Done, Encode


def _server(max_batch: int) -> tuple[EncodeServer, list]:
    sent: list = []
    srv = object.__new__(EncodeServer)  # no model, no Redis: the queue logic only
    srv.max_batch = max_batch
    srv.send = sent.append
    srv._queue = deque()
    srv._streams = {}
    srv._cv = threading.Condition()
    return srv, sent


def _encode(rid: str, n: int, choices: int = 1) -> Encode:
    """An encode command for a request with ``n`` images (and ``choices``)."""
    images = [ImageRef(hash=f"{i:064x}", offset=i, num_tokens=4) for i in range(n)]
    payload = StagePayload(request_id=rid, model="m", prompt_token_ids=list(range(4 * n + 1)),
                           sampling=Sampling(n=choices), created=0.0,
                           images=images)  # fmt: skip
    return Encode(payload)


def test_a_batch_takes_waiting_requests_in_order_up_to_the_image_limit() -> None:
    srv, _ = _server(max_batch=4)
    for rid, n in (("a", 1), ("b", 2), ("c", 2), ("d", 1)):
        srv.handle(_encode(rid, n))
    with srv._cv:
        first = srv._take(4)
        second = srv._take(4)
    assert [rid for rid, _ in first] == ["a", "b"]  # c would make 5 images
    assert [rid for rid, _ in second] == ["c", "d"]
    assert not srv._queue


def test_a_request_with_more_images_than_the_limit_still_goes_alone() -> None:
    srv, _ = _server(max_batch=2)
    srv.handle(_encode("big", 3))
    srv.handle(_encode("small", 1))
    with srv._cv:
        assert [rid for rid, _ in srv._take(2)] == ["big"]
        assert [rid for rid, _ in srv._take(2)] == ["small"]


def test_no_batching_is_one_request_at_a_time() -> None:
    srv, _ = _server(max_batch=1)
    for rid in "xyz":
        srv.handle(_encode(rid, 1))
    with srv._cv:
        assert [[rid for rid, _ in srv._take(1)] for _ in range(3)] == [["x"], ["y"], ["z"]]


def test_an_abort_drops_a_waiting_request_and_says_it_ended() -> None:
    srv, sent = _server(max_batch=8)
    srv.handle(_encode("keep", 1))
    srv.handle(_encode("drop", 1))
    srv.handle(Abort("drop"))
    srv.handle(Abort("never-seen"))  # nothing waiting under that id: nothing happens
    assert [rid for rid, _ in srv._queue] == ["keep"]
    assert len(sent) == 1
    (reply,) = sent
    assert isinstance(reply, Done)
    (done,) = reply.completions
    assert done.request_id == "drop" and done.finish_reason == "abort"


def test_a_request_of_choices_is_aborted_by_a_choice_s_cancel() -> None:
    """n > 1: the API cancels each choice's stream; the encode worker drops the request
    waiting for the tower (it would fail each choice's stream, which it keeps)."""
    srv, sent = _server(max_batch=8)
    srv.handle(_encode("many", 1, choices=3))
    assert srv._streams["many"] == ["many.c0", "many.c1", "many.c2"]
    srv.handle(Abort("many.c1"))
    assert not srv._queue and not srv._streams
    assert [c.request_id for reply in sent for c in reply.completions] == ["many"]
