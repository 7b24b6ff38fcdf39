"""Publish a worker's KV events to the Redis index, in order, from one thread.

The engine loop hands each step's :class:`kvbm.block_pool.KVEvent` list over with
:meth:`KVEventPublisher.publish` (a list append: it never waits on Redis and wakes no
thread, so the engine does not trade the GIL with the publisher every step). Every
``interval_s`` the publisher thread folds everything queued into one batch, numbers it
with the worker's next sequence number and applies it with one script call
(:data:`kvbm.index.APPLY_LUA`).

* It starts with ``cleared`` (this worker's old entries, if its id was used before, go).
* A batch that fails to reach Redis is kept and retried with the same number, so the
  index never sees events out of order.
* When the index answers ``resync`` (it lost events, e.g. Redis restarted), the publisher
  sends ``cleared`` plus a snapshot of every block the pool has cached (``snapshot``).
* :meth:`close` sends a final ``cleared``: a worker leaving on purpose takes its entries
  with it. A worker that dies is cleaned up by the router (its heartbeat key is gone).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import redis

from kvbm.block_pool import KVEvent
from kvbm.index import KVIndex

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self,
        client: redis.Redis,
        pool: str,
        worker_id: str,
        snapshot: Callable[[], list[int]],
        retry_s: float = 0.5,
        interval_s: float = 0.01,
    ) -> None:
        self.index = KVIndex(client, pool)
        self.worker_id = worker_id
        self._snapshot = snapshot
        self._retry_s = retry_s
        self._interval_s = interval_s
        self._pending: deque[list[KVEvent]] = deque()
        self._closing = False
        self._seq = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set only to close
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.batches_sent = 0
        self.events_sent = 0
        self.resyncs = 0
        self.errors = 0

    def start(self) -> KVEventPublisher:
        self._pending.append([KVEvent("cleared", [])])
        self._thread.start()
        return self

    def publish(self, events: list[KVEvent]) -> None:
        self._pending.append(events)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued and a final ``cleared``, then stop."""
        self._pending.append([KVEvent("cleared", [])])
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        self._stop.set()

    def stats(self) -> dict[str, int]:
        return {
            "kv_event_batches": self.batches_sent,
            "kv_events": self.events_sent,
            "kv_event_resyncs": self.resyncs,
            "kv_event_errors": self.errors,
        }

    # ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            closing = self._closing
            events: list[KVEvent] = []
            while self._pending:
                events.extend(self._pending.popleft())
            if events:
                self._send(_fold(events), closing)
            if closing:
                return

    def _send(self, batch: list[tuple[str, list[int]]], closing: bool) -> None:
        while True:
            try:
                res = self.index.apply(self.worker_id, self._seq, batch)
            except redis.RedisError as e:
                self.errors += 1
                if closing or self._stop.is_set():
                    log.warning("KV events not delivered on close: %s", e)
                    return
                log.warning("KV event batch %d failed (%s); retrying", self._seq, e)
                self._stop.wait(self._retry_s)
                continue
            if res.status == -1:  # the index lost events: replace this worker's entries
                self.resyncs += 1
                log.warning("KV index out of step (seq %d, index has %d): resyncing",
                            self._seq, res.last_seq)  # fmt: skip
                try:
                    cached = self._snapshot()
                except Exception:  # noqa: BLE001 - an empty entry set is still consistent
                    log.exception("KV snapshot failed; index entries cleared")
                    cached = []
                batch = [("cleared", []), ("stored", cached)]
                continue
            self._seq += 1
            self.batches_sent += 1
            self.events_sent += len(batch)
            return


def _fold(events: list[KVEvent]) -> list[tuple[str, list[int]]]:
    """Merge runs of same-kind events (order kept: a removed-then-stored block must end
    up stored)."""
    out: list[tuple[str, list[int]]] = []
    for ev in events:
        if out and out[-1][0] == ev.kind and ev.kind != "cleared":
            out[-1][1].extend(ev.block_hashes)
        else:
            out.append((ev.kind, list(ev.block_hashes)))
    return out
