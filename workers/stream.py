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
from collections import deque
from collections.abc import Callable
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
                "code": out.error_code or "engine_error",
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


class FramePublisher:
    """Numbers frames per request and publishes them from its own thread.

    The engine thread only hands a step's outputs over (``publish_outputs`` returns at
    once); the publisher thread sends everything queued since its last round trip in one
    pipeline, in order, then calls ``on_published`` with those outputs — so a task thread
    waiting for its request is woken only once the terminal frame is out.
    """

    def __init__(
        self,
        client: redis.Redis,
        on_published: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        self._r = client
        self._on_published = on_published
        self._seq: dict[str, int] = {}
        self._queue: deque[RequestOutput] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="frame-publisher", daemon=True)
        self._thread.start()
        self.frames_published = 0
        self.publish_errors = 0

    def publish_outputs(self, outputs: list[RequestOutput]) -> None:
        with self._cv:
            self._queue.extend(outputs)
            self._cv.notify()

    def publish_error(self, request_id: str, message: str, code: str = "") -> None:
        """End ``request_id``'s stream with an error frame (queued behind its other frames)."""
        from workers.engine import RequestOutput  # local: keep module import torch-free

        out = RequestOutput(request_id, [], "", finished=True, finish_reason="error")
        out.error = message
        out.error_code = code
        self.publish_outputs([out])

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)

    # ----------------------------------------------------------------------------------
    def _next_seq(self, request_id: str, finished: bool) -> int:
        n = self._seq.get(request_id, 0)
        if finished:
            self._seq.pop(request_id, None)
        else:
            self._seq[request_id] = n + 1
        return n

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if not self._queue and self._stopped:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                pipe = self._r.pipeline(transaction=False)
                for out in batch:
                    frame = output_frame(out, self._next_seq(out.request_id, out.finished))
                    pipe.publish(tokens_channel(out.request_id), json.dumps(frame))
                pipe.execute()
                self.frames_published += len(batch)
            except redis.RedisError as e:  # the API notices the gap or times out
                self.publish_errors += 1
                log.error("publishing %d frames failed: %s", len(batch), e)
            finally:
                if self._on_published is not None:
                    try:
                        self._on_published(batch)
                    except Exception:  # noqa: BLE001
                        log.exception("on_published callback failed")
