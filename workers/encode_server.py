"""The engine process of an encode worker: the vision tower alone, no text model.

An ``encode`` command names a request and its images (content hashes; the bytes are in
Redis). One thread takes every request waiting when it comes round and runs all their
images through the tower as one batch (images seen before come from the embedding cache),
stages each embedding once in the transfer backend (:mod:`workers.transfer.embeddings`)
and answers with an :class:`kvbm.protocol.EncodeHandle` naming where they are. A request
whose image cannot be encoded (its bytes expired, or do not decode) ends its stream (each
choice's, for n > 1) with an error frame, and its handle says so; the others of the batch
go on.

Speaks the same pipe protocol as the text engine's process (:mod:`workers.engine_ipc`):
``Encode`` and ``Abort`` in, ``Done`` and ``Stats`` out; :mod:`workers.engine_proc` starts
it, with its tower and transfer backend, and runs the pipe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from cluster.stats import EngineStats
from kvbm.protocol import EncodeHandle, ImageRef, choice_request_id
from workers.engine_ipc import Abort, Completion, Done, Encode, Reply, Run, Stats
from workers.images import ImageUnavailable, export
from workers.stream import publish_error_frame

if TYPE_CHECKING:
    from collections.abc import Callable

    import redis

    from workers.images import ImageEncoder
    from workers.transfer.embeddings import EmbeddingTransfer

log = logging.getLogger(__name__)


class EncodeServer:
    def __init__(self, client: redis.Redis, send: Callable[[Reply], None],
                 encoder: ImageEncoder, transfer: EmbeddingTransfer, worker_id: str,
                 max_batch: int, stats_period_s: float,
                 frame_log_ttl_s: float = 0.0) -> None:  # fmt: skip
        self.redis = client
        self.frame_log_ttl_s = frame_log_ttl_s
        self.send = send
        self.encoder = encoder
        self.transfer = transfer
        self.worker_id = worker_id
        self.max_batch = max_batch  # images per vision-tower forward
        self.stats_period_s = stats_period_s
        self._queue: deque[tuple[str, list[ImageRef]]] = deque()
        self._streams: dict[str, list[str]] = {}  # request -> its streams (n > 1: choices')
        self._cv = threading.Condition()
        self._stop = False
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name="encoder", daemon=True)
        self._thread.start()
        threading.Thread(target=self._report, name="stats", daemon=True).start()

    def handle(self, cmd: Run | Abort) -> None:
        if isinstance(cmd, Encode):
            with self._cv:
                self._queue.append((cmd.request_id, list(cmd.payload.images)))
                self._streams[cmd.request_id] = cmd.payload.stream_ids
                self._cv.notify()
        elif isinstance(cmd, Abort):  # a request still waiting is dropped; one in the tower ends
            rid = choice_request_id(cmd.request_id) or cmd.request_id
            with self._cv:  # (the next stage skips it: the API has marked it cancelled)
                gone = [e for e in self._queue if e[0] == rid]
                for e in gone:
                    self._queue.remove(e)
                for e in gone:
                    self._streams.pop(e[0], None)
            for rid, _ in gone:
                self.send(Done([Completion(rid, "abort")]))
        else:
            raise AssertionError(f"an encode worker runs encode commands, not {cmd!r}")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._queue), encode_requests=self.requests,
                           images=self.encoder.counters(),
                           embedding_transfer=self.transfer.stats())  # fmt: skip

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(5)
        self.transfer.close()

    # ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch = self._take(self.max_batch)
            self._encode(batch)

    def _take(self, max_images: int) -> list[tuple[str, list[ImageRef]]]:
        """The waiting requests, oldest first, up to ``max_images`` images (at least one
        request, however many images it has). Holds the condition's lock."""
        batch: list[tuple[str, list[ImageRef]]] = []
        n = 0
        while self._queue and (not batch or n + len(self._queue[0][1]) <= max_images):
            rid, ims = self._queue.popleft()
            batch.append((rid, ims))
            n += len(ims)
        return batch

    def _encode(self, batch: list[tuple[str, list[ImageRef]]]) -> None:
        """Every image of ``batch`` through the tower in one go; a batch with an image that
        cannot be encoded is redone request by request, so only that request fails."""
        try:
            self.encoder.encode([im for _, ims in batch for im in ims])
        except ImageUnavailable:
            if len(batch) > 1:
                for one in batch:
                    self._encode([one])
                return
        for rid, images in batch:
            self.requests += 1
            with self._cv:
                streams = self._streams.pop(rid, [rid])
            try:
                embeds = self.encoder.encode(images)  # from the cache now
                refs = export(rid, images, embeds, self.transfer)
            except Exception as e:  # noqa: BLE001 - the stream must end, the worker go on
                log.warning("[%s] encoding failed: %s", rid, e)
                code = "image_unavailable" if isinstance(e, ImageUnavailable) else "encode_failed"
                for sid in streams:  # a request of n > 1 choices: every choice's stream
                    publish_error_frame(self.redis, sid, f"encoding failed: {e}", code, 0,
                                        self.frame_log_ttl_s)  # fmt: skip
                handle = EncodeHandle(request_id=rid, encode_worker=self.worker_id,
                                      error=str(e))  # fmt: skip
                self.send(Done([Completion(rid, "error", error=str(e), handle=handle)]))
                continue
            handle = EncodeHandle(request_id=rid, encode_worker=self.worker_id,
                                  embeddings=refs)  # fmt: skip
            self.send(Done([Completion(rid, None, handle=handle)]))

    def _report(self) -> None:
        while not self._stop:
            time.sleep(self.stats_period_s)
            try:
                self.send(Stats(self.stats()))
            except OSError:
                return
