"""The API's traffic counters in Redis: what the planner reads of the cluster's load.

Every API process counts its requests in memory (:class:`TrafficCounter`: started, with
its prompt length; first token, with its TTFT; each gap between streamed frames, its ITL;
finished, with its output length) and adds the counts to Redis once a second in one
pipelined write (:func:`flush_loop`), into the hash of the current time bucket
(:func:`cluster.keys.traffic_key`, ``BUCKET_S`` seconds a bucket, kept an hour). Any
reader sees the whole cluster's traffic (:func:`read_traffic`): every replica adds to the
same buckets.

A bucket's fields::

    requests, finished                  counts
    isl_sum, osl_sum                    prompt / output tokens
    ttft_sum, itl_sum                   seconds
    ttft:<i>, itl:<i>                   histogram counts: observations <= TTFT_BOUNDS[i]
                                        (and above the bound before); i = len(bounds): above all
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis

from cluster.keys import traffic_key
from cluster.resp import as_str

log = logging.getLogger(__name__)

BUCKET_S = 5  # seconds a bucket covers
TTL_S = 3600  # a bucket's hash expires this long after its last write
FLUSH_S = 1.0  # how often an API process adds its counts


def _geometric(lo: float, ratio: float, n: int) -> tuple[float, ...]:
    return tuple(float(f"{lo * ratio**i:.3g}") for i in range(n))


# 20 % apart, so the linear estimate inside a bucket is within ~10 % of the truth:
# TTFT 5 ms .. 22 s, ITL 0.5 ms .. 2.2 s (the SLA targets: ~100-2000 ms, ~10-100 ms)
TTFT_BOUNDS = _geometric(0.005, 1.2, 47)
ITL_BOUNDS = _geometric(0.0005, 1.2, 47)


# ======================================================================================
# Writing: one API process's counts
# ======================================================================================
class TrafficCounter:
    """One API process's traffic since its last flush: in-memory adds per event (called on
    the event loop's thread), written to Redis by :meth:`flush`."""

    def __init__(self) -> None:
        self._take_all()

    # --- the events -------------------------------------------------------------------
    def started(self, isl: int) -> None:
        self.requests += 1
        self.isl_sum += isl

    def first_token(self, ttft_s: float) -> None:
        self.ttft_sum += ttft_s
        self.ttft[bisect_left(TTFT_BOUNDS, ttft_s)] += 1

    def token_gap(self, itl_s: float) -> None:
        self.itl_sum += itl_s
        self.itl[bisect_left(ITL_BOUNDS, itl_s)] += 1

    def finished(self, osl: int) -> None:
        self.finished_ += 1
        self.osl_sum += osl

    # --- to Redis ---------------------------------------------------------------------
    def take(self) -> dict[str, int | float]:
        """The counts since the last take (the fields that moved), and start over."""
        d: dict[str, int | float] = {"requests": self.requests, "finished": self.finished_,
                                     "isl_sum": self.isl_sum, "osl_sum": self.osl_sum,
                                     "ttft_sum": self.ttft_sum,
                                     "itl_sum": self.itl_sum}  # fmt: skip
        d.update({f"ttft:{i}": c for i, c in enumerate(self.ttft)})
        d.update({f"itl:{i}": c for i, c in enumerate(self.itl)})
        self._take_all()
        return {k: v for k, v in d.items() if v}

    def give_back(self, counts: dict[str, int | float]) -> None:
        """Counts :meth:`take` returned that could not be written: they go out next time."""
        for k, v in counts.items():
            kind, _, i = k.partition(":")
            if i:
                (self.ttft if kind == "ttft" else self.itl)[int(i)] += int(v)
            elif k == "finished":
                self.finished_ += int(v)
            else:
                setattr(self, k, getattr(self, k) + v)

    async def flush(self, client: aioredis.Redis, now: float | None = None) -> int:
        """Add the counts since the last flush to the current bucket (one pipeline);
        the number of fields written. On a Redis error the counts are kept for the next."""
        counts = self.take()
        if not counts:
            return 0
        key = traffic_key(int((time.time() if now is None else now) // BUCKET_S))
        pipe = client.pipeline(transaction=False)
        for k, v in counts.items():
            if isinstance(v, int):
                pipe.hincrby(key, k, v)
            else:
                pipe.hincrbyfloat(key, k, v)
        pipe.expire(key, TTL_S)
        try:
            await pipe.execute()
        except BaseException:
            self.give_back(counts)
            raise
        return len(counts)

    def _take_all(self) -> None:
        self.requests = 0
        self.finished_ = 0
        self.isl_sum = 0
        self.osl_sum = 0
        self.ttft_sum = 0.0
        self.itl_sum = 0.0
        self.ttft = [0] * (len(TTFT_BOUNDS) + 1)
        self.itl = [0] * (len(ITL_BOUNDS) + 1)


async def flush_loop(counter: TrafficCounter, client: aioredis.Redis,
                     period_s: float = FLUSH_S) -> None:  # fmt: skip
    """The API's background task: flush every ``period_s`` until cancelled (a Redis error
    is logged; the counts wait for the next flush)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await counter.flush(client)
        except (redis.RedisError, OSError) as e:
            log.warning("traffic counters not written (kept for the next try): %s", e)


# ======================================================================================
# Reading: the cluster's traffic over a window
# ======================================================================================
@dataclass(slots=True)
class Traffic:
    """The traffic of every API process over the buckets of a window."""

    span_s: float  # from the start of the first bucket read to now
    requests: int = 0
    finished: int = 0
    isl_sum: int = 0
    osl_sum: int = 0
    ttft_sum: float = 0.0
    itl_sum: float = 0.0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS) + 1))
    itl_counts: list[int] = field(default_factory=lambda: [0] * (len(ITL_BOUNDS) + 1))
    # bucket number -> its raw fields, as Redis holds them (for recording to a file)
    per_bucket: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Requests started per second."""
        return self.requests / self.span_s if self.span_s > 0 else 0.0

    @property
    def isl_mean(self) -> float | None:
        return self.isl_sum / self.requests if self.requests else None

    @property
    def osl_mean(self) -> float | None:
        return self.osl_sum / self.finished if self.finished else None

    @property
    def ttft_count(self) -> int:
        return sum(self.ttft_counts)

    @property
    def itl_count(self) -> int:
        return sum(self.itl_counts)

    def ttft_quantile(self, q: float) -> float | None:
        """TTFT's ``q`` quantile in seconds (None: no first token in the window)."""
        return histogram_quantile(TTFT_BOUNDS, self.ttft_counts, q)

    def itl_quantile(self, q: float) -> float | None:
        """ITL's ``q`` quantile in seconds (None: no gap between frames in the window)."""
        return histogram_quantile(ITL_BOUNDS, self.itl_counts, q)

    def add(self, bucket: int, raw: dict[str, float]) -> None:
        """Fold one bucket's fields in."""
        self.per_bucket[bucket] = raw
        for k, v in raw.items():
            kind, _, i = k.partition(":")
            if kind in ("ttft", "itl") and i.isdigit():
                counts = self.ttft_counts if kind == "ttft" else self.itl_counts
                counts[min(int(i), len(counts) - 1)] += int(v)  # other bounds: the top
            elif k in ("requests", "finished", "isl_sum", "osl_sum"):
                setattr(self, k, getattr(self, k) + int(v))
            elif k in ("ttft_sum", "itl_sum"):
                setattr(self, k, getattr(self, k) + v)


def read_traffic(client: redis.Redis, window_s: float, now: float | None = None) -> Traffic:
    """The traffic of the buckets from ``now - window_s`` to ``now`` (the first and last
    ones partly in the window: ``span_s`` says what they cover)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    now = time.time() if now is None else now
    first, last = int((now - window_s) // BUCKET_S), int(now // BUCKET_S)
    buckets = range(first, last + 1)
    pipe = client.pipeline(transaction=False)
    for b in buckets:
        pipe.hgetall(traffic_key(b))
    out = Traffic(span_s=now - first * BUCKET_S)
    for b, h in zip(buckets, pipe.execute(), strict=True):
        if h:
            out.add(b, {as_str(k): float(v) for k, v in h.items()})
    return out


def histogram_quantile(bounds: tuple[float, ...], counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram of ``counts`` per bucket (``len(bounds) + 1``:
    the last above every bound), linear inside its bucket (from the bound below, or 0);
    one in the last bucket is reported as the highest bound. None: no observations."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * max(rank - seen, 0.0) / c
        seen += c
    return bounds[-1]  # not reached: rank <= total
