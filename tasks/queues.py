"""Which stage queues an operator sees, and their depths: one view for Flower's broker page,
``/metrics`` and ``conveyor queues``.

The queues are read from the worker registry (:func:`cluster.queues.queue_depths`), not
from what the workers last told Flower: every pool of the stage table with its shared
queue, and each worker's own queue while the worker is live or its queue still holds
messages. A pool outside this deployment's mode is shown only while it has workers or
messages, so a new stage in :data:`tasks.modes.MODES` shows up without a change here.
"""

from __future__ import annotations

import redis

from cluster.queues import PoolQueues, queue_depths
from tasks.modes import ALL_POOLS, Mode

POOLS = ALL_POOLS  # every pool is read: a worker of another mode's pool is still shown


def shown(snapshot: list[PoolQueues], mode: Mode) -> list[PoolQueues]:
    """The pools of ``mode`` (always, in chain order), then any other pool in use."""
    by_pool = {p.pool: p for p in snapshot}
    out = [by_pool[p] for p in mode.pools if p in by_pool]
    return out + [p for p in snapshot if p.pool not in mode.pools and p.in_use]


def snapshot(client: redis.Redis, mode: Mode) -> list[PoolQueues]:
    """The queues to show for a deployment in ``mode``, with their depths (one round trip)."""
    return shown(queue_depths(client, POOLS), mode)


def queue_names(pools: list[PoolQueues]) -> list[str]:
    return [q for p in pools for q in p.queues]


def format_table(pools: list[PoolQueues]) -> str:
    """A terminal table: each pool's shared queue, its workers' own queues (``left``: a
    departed worker's, still holding messages), then the pool's total."""
    rows = [("POOL", "QUEUE", "STATE", "DEPTH")]
    for p in pools:
        rows.append((p.pool, p.pool, "shared", str(p.shared)))
        rows += [(p.pool, w.queue, "live" if w.live else "left", str(w.depth)) for w in p.workers]
        live = sum(w.live for w in p.workers)
        rows.append((p.pool, "(total)", f"{live} live worker(s)", str(p.total)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=False)) + "  "
        + r[3].rjust(widths[3]) for r in rows
    )  # fmt: skip
