"""Token frames on Redis pub/sub: ``tokens:{request_id}``.

Frame (JSON), one per engine step per request::

    {"seq": 0, "token_ids": [..], "text": ".."}                     # a delta
    {"seq": 7, "token_ids": [..], "text": "..", "done": true,
     "finish_reason": "stop", "stop_reason": null,
     "usage": {"prompt_tokens": .., "completion_tokens": .., "cached_tokens": ..}}
    {"seq": 3, "done": true, "error": {"message": .., "type": .., "code": ..}}

``seq`` counts from 0 per request with no gaps; the frame with ``done`` is always last.
One step's frames for all requests go out in one pipelined round trip.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:  # keep this module torch-free: the API reads its channel names
    from workers.engine import RequestOutput

log = logging.getLogger(__name__)

TOKENS_CHANNEL = "tokens:{}"
CANCEL_CHANNEL = "conveyor:cancel"
CANCELLED_KEY = "conveyor:cancelled:{}"


def tokens_channel(request_id: str) -> str:
    return TOKENS_CHANNEL.format(request_id)


def output_frame(out: RequestOutput, seq: int) -> dict:
    frame: dict = {"seq": seq, "token_ids": out.token_ids, "text": out.text}
    if out.finished:
        frame["done"] = True
        if out.finish_reason == "error":
            frame["error"] = {
                "message": out.error or "generation failed",
                "type": "server_error",
                "code": "engine_error",
            }
        else:
            frame["finish_reason"] = out.finish_reason
            frame["stop_reason"] = out.stop_reason
        frame["usage"] = {
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_output_tokens,
            "cached_tokens": out.num_cached_tokens,
        }
    return frame


def error_frame(seq: int, message: str, type_: str = "server_error", code: str = "") -> dict:
    return {"seq": seq, "done": True, "error": {"message": message, "type": type_, "code": code}}


class FramePublisher:
    """Numbers frames per request and publishes each step's batch in one pipeline."""

    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.frames_published = 0

    def _next_seq(self, request_id: str, finished: bool) -> int:
        with self._lock:
            n = self._seq.get(request_id, 0)
            if finished:
                self._seq.pop(request_id, None)
            else:
                self._seq[request_id] = n + 1
            return n

    def publish_outputs(self, outputs: list[RequestOutput]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for out in outputs:
            frame = output_frame(out, self._next_seq(out.request_id, out.finished))
            pipe.publish(tokens_channel(out.request_id), json.dumps(frame))
        pipe.execute()
        self.frames_published += len(outputs)

    def publish_error(self, request_id: str, message: str, code: str = "") -> None:
        frame = error_frame(self._next_seq(request_id, True), message, code=code)
        self._r.publish(tokens_channel(request_id), json.dumps(frame))
