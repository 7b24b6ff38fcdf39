"""Publish a worker's KV events to the Redis index, in order, from the engine loop's thread.

The engine loop hands each step's :class:`kvbm.block_pool.KVEvent` list to
:meth:`KVEventPublisher.publish`. At most every ``interval_s`` (and whenever the engine
goes idle) the publisher folds what it holds into one batch, numbers it with the worker's
next sequence number and writes one script call (:data:`cluster.index.APPLY_LUA`) through a
:class:`CommandWriter`: the engine process's frame connection, which pipelines it with the
step's token frames and reads the reply on a later write, with others (or at once when the
engine goes idle: nothing would read it for a while then). No thread, and while the engine
works no round trip waited on: a publisher thread of its own would take CPU and the GIL
from the engine loop, where this costs the loop an encoding and a write per step
(docs/performance.md, "KV events on the frames' connection").

* Events name their tier (G1 the engine pool, G2 host memory, G3 disk); ``cleared`` covers
  every tier.
* The first batch starts with ``cleared`` (this worker's old entries, if its id was used
  before, go).
* A batch that does not apply (lost with its connection, refused by Redis, or answered
  ``resync`` because the index lost events, e.g. Redis restarted) makes the next batch
  ``cleared`` plus a snapshot of every block the pool has cached (``snapshot``), which
  the index always applies: it never keeps events out of order. Answers to batches sent
  before that resync are ignored.
* :meth:`close` sends a final ``cleared`` and waits for it: a worker leaving on purpose
  takes its entries with it. A worker that dies is cleaned up by the router (its heartbeat
  key is gone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import redis

from cluster.index import Batch, apply_command
from kvbm.block_pool import KVEvent
from kvbm.protocol import G1

log = logging.getLogger(__name__)

Reply = object  # a decoded Redis reply, or the exception that stands for it


class CommandWriter(Protocol):
    def send_command(self, args: tuple, on_reply: Callable[[Reply], None]) -> None:
        """Write one command now; call ``on_reply`` with its reply (or an exception: an
        error reply, a lost connection) when it has been read."""

    def wait_replies(self, timeout: float) -> bool:
        """Read every reply still owed, up to ``timeout`` seconds; False if some are not."""


class KVEventPublisher:
    def __init__(
        self,
        writer: CommandWriter,
        pool: str,
        worker_id: str,
        snapshot: Callable[[], list[int] | dict[int, list[int]]],
        interval_s: float = 0.01,
    ) -> None:
        """``snapshot``: every block hash the engine has cached, per tier (a list: G1's
        alone), called on the thread that calls :meth:`publish` (the engine loop's)."""
        self._writer = writer
        self.pool = pool
        self.worker_id = worker_id
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._pending: list[KVEvent] = [KVEvent("cleared", [])]
        self._seq = 0
        self._last_sent = 0.0
        self._resync_from = 0  # the number of the last batch that started with cleared
        self._resync = False  # set by a reply: the next batch is cleared + snapshot
        self._script_loaded = False  # EVALSHA once an EVAL has loaded the script
        self.batches_sent = 0
        self.events_sent = 0
        self.resyncs = 0
        self.errors = 0

    def start(self) -> KVEventPublisher:
        """Send the opening ``cleared`` now (before the engine loop runs)."""
        self.flush()
        return self

    def publish(self, events: list[KVEvent], idle: bool = False) -> None:
        """Queue ``events``; send a batch if ``interval_s`` has passed since the last one,
        or if ``idle`` (the engine has nothing left to run: nothing would send it later)."""
        if events:
            self._pending.extend(events)
        if not (self._pending or self._resync):
            return
        if idle:
            self._send()
            # nothing will read its answer for a while: read it now (one round trip, the
            # engine has nothing else to do), so a refused batch is repaired at once
            if self._writer.wait_replies(1.0) and self._resync:
                self._send()
        elif time.monotonic() - self._last_sent >= self._interval_s:
            self._send()

    def flush(self) -> None:
        """Send what is queued now (not while the engine loop may be publishing)."""
        if self._pending or self._resync:
            self._send()

    def close(self, timeout: float = 5.0) -> None:
        """Send a final ``cleared`` (it supersedes what is queued, a resync included) and
        wait for Redis to apply it."""
        self._resync = False
        self._pending = [KVEvent("cleared", [])]
        self._send()
        if not self._writer.wait_replies(timeout):
            log.warning("KV events: the final batch was not confirmed in %.1fs", timeout)

    # ----------------------------------------------------------------------------------
    def _send(self) -> None:
        self._last_sent = time.monotonic()
        events, self._pending = self._pending, []
        batch = _fold(events)
        seq = self._seq
        if self._resync:
            self._resync = False
            self.resyncs += 1
            # what is cached now, whatever the lost events said; later ones follow it
            snap = self._snapshot()
            tiers = snap if isinstance(snap, dict) else {G1: snap}
            batch = [("cleared", [], G1)]
            batch += [("stored", list(hs), t) for t, hs in sorted(tiers.items()) if hs]
        if batch[0][0] == "cleared":
            self._resync_from = seq
        self._seq += 1
        self.batches_sent += 1
        self.events_sent += len(batch)
        cmd = apply_command(self.pool, self.worker_id, seq, batch, load=not self._script_loaded)
        self._script_loaded = True
        self._writer.send_command(cmd, partial(self._on_reply, seq))

    def _on_reply(self, seq: int, reply: Reply) -> None:
        """Runs on whichever thread reads the reply: it only sets flags."""
        if isinstance(reply, list) and int(reply[0]) >= 0:
            return  # applied (1) or a duplicate (0)
        if seq < self._resync_from:
            return  # a resync sent after this batch repairs it
        if isinstance(reply, BaseException):
            self.errors += 1
            if isinstance(reply, redis.exceptions.NoScriptError):
                self._script_loaded = False  # Redis lost its scripts: EVAL loads it again
            log.warning("KV event batch %d not applied (%s): resyncing", seq, reply)
        else:
            log.warning("KV index out of step (batch %d, index at %s): resyncing",
                        seq, reply[1] if isinstance(reply, list) else reply)  # fmt: skip
        self._resync = True


def _fold(events: list[KVEvent]) -> Batch:
    """Merge runs of events of one kind and tier (order kept: a removed-then-stored block
    must end up stored)."""
    out: Batch = []
    for ev in events:
        last = out[-1] if out else None
        if last and last[0] == ev.kind and last[2] == ev.tier and ev.kind != "cleared":
            last[1].extend(ev.block_hashes)
        else:
            out.append((ev.kind, list(ev.block_hashes), ev.tier))
    return out
