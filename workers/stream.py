"""Token frames on Redis pub/sub: ``tokens:{request_id}``.

Frame (JSON), one per engine step per request::

    {"seq": 0, "token_ids": [..], "text": ".."}                     # a delta
    {"seq": 7, "token_ids": [..], "text": "..", "done": true,
     "finish_reason": "stop", "stop_reason": null,
     "usage": {"prompt_tokens": .., "completion_tokens": .., "cached_tokens": ..}}
    {"seq": 3, "done": true, "error": {"message": .., "type": .., "code": ..}}

``seq`` counts from 0 per request with no gaps; the frame with ``done`` is always last.
One step's frames for all requests go out in one round trip (a Lua multi-publish).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
import redis

if TYPE_CHECKING:  # keep this module torch-free: the API reads its channel names
    from workers.engine_core import RequestOutput

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
            frame["error"] = _error(out.error or "generation failed",
                                    out.error_code or "engine_error")  # fmt: skip
        else:
            frame["finish_reason"] = out.finish_reason
            frame["stop_reason"] = out.stop_reason
        frame["usage"] = {
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_output_tokens,
            "cached_tokens": out.num_cached_tokens,
        }
    return frame


def publish_error_frame(
    client: redis.Redis, request_id: str, message: str, code: str, seq: int = 0
) -> None:
    """A terminal error frame from outside the engine (e.g. a stage task that failed)."""
    frame = {"seq": seq, "done": True, "token_ids": [], "text": "", "error": _error(message, code)}
    client.publish(tokens_channel(request_id), json.dumps(frame))


def _error(message: str, code: str) -> dict:
    return {"message": message, "type": "server_error", "code": code}


# Publishes a whole step's frames in one command: ARGV = channel1, frame1, channel2, ...
_MULTI_PUBLISH = """
for i = 1, #ARGV, 2 do redis.call('PUBLISH', ARGV[i], ARGV[i + 1]) end
return #ARGV / 2
"""


class FramePublisher:
    """Numbers frames per request and publishes them from its own thread.

    The engine thread only hands a step's outputs over (``publish_outputs`` is a C-level
    queue put); the publisher thread sends everything queued since its last round trip in
    one Lua call, in order, then calls ``on_published`` with those outputs — so whoever
    waits for a request learns it finished only once its terminal frame is out.
    """

    def __init__(
        self,
        client: redis.Redis,
        on_published: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        self._r = client
        self._multi_publish = client.register_script(_MULTI_PUBLISH)
        self._on_published = on_published
        self._seq: dict[str, int] = {}
        self._queue: queue.SimpleQueue[list[RequestOutput] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="frame-publisher", daemon=True)
        self._thread.start()
        self.frames_published = 0
        self.publish_errors = 0

    def publish_outputs(self, outputs: list[RequestOutput]) -> None:
        self._queue.put(outputs)

    def start_at(self, request_id: str, seq: int) -> None:
        """Number ``request_id``'s next frame ``seq`` (a decode worker continues the stream
        a prefill worker began). Queued, so it applies before frames submitted after it."""
        self._queue.put(("start_at", request_id, seq))  # type: ignore[arg-type]

    def publish_error(self, request_id: str, message: str, code: str = "") -> None:
        """End ``request_id``'s stream with an error frame (queued behind its other frames)."""
        from workers.engine_core import RequestOutput

        out = RequestOutput(request_id, [], "", finished=True, finish_reason="error")
        out.error = message
        out.error_code = code
        self.publish_outputs([out])

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
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
        stopping = False
        while not stopping:
            item = self._queue.get()
            batch: list[RequestOutput] = []
            while True:
                if item is None:
                    stopping = True
                elif isinstance(item, tuple):  # ("start_at", request_id, seq)
                    self._seq[item[1]] = item[2]
                else:
                    batch.extend(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if not batch:
                continue
            args: list[bytes | str] = []
            for out in batch:
                # a prefill worker's part of the stream ends with its (non-terminal) first frame
                seq = self._next_seq(out.request_id, out.finished or out.prefilled)
                frame = output_frame(out, seq)
                args.append(tokens_channel(out.request_id))
                args.append(orjson.dumps(frame))
            try:
                self._multi_publish(args=args)
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
