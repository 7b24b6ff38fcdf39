"""A pool's performance model: an engine step's time against the tokens in it, fitted live.

Every worker reports its last engine steps in its heartbeat (``EngineStats.step_samples``:
step number, wall time, prompt tokens computed, decoding sequences, KV tokens those
sequences read). A continuous-batching step costs a fixed part (the weights read once), a
part per prompt token computed, a part per decoding sequence and a part per KV token read
by attention::

    step_s = base + per_prefill_token * P + per_seq * S + per_kv_token * K

:class:`StepModel` fits those four non-negative coefficients by least squares over a
sliding window of samples, and from them answers what the planner asks: the inter-token
latency at a given load, the time to first token behind a given queue, and the highest
request rate one worker sustains within both targets (:meth:`StepModel.capacity`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES = 16  # fewer than this: no fit (the planner falls back on what it observes)
SERVICE_CV2 = 0.25  # squared coefficient of variation of a prompt's prefill time
VARIES = 0.05  # a quantity whose spread is under this share of its mean is not fitted
CALIBRATE_WEIGHT = 0.2  # how far one observation moves a scale (about 5 ticks to settle)
# observed / modelled quantile, as far as it is believed: never under 1 (a window's p90
# lags a queue that is still growing, and the wait's quantile is the model's cautious
# side: a reading under the model's figure is not taken as the pool doing better)
SCALE_BOUNDS = (1.0, 2.0)


@dataclass(slots=True)
class Coefficients:
    base: float  # s per step
    per_prefill_token: float  # s per prompt token computed in the step
    per_seq: float  # s per decoding sequence
    per_kv_token: float  # s per KV token read

    def step(self, prefill: float, seqs: float, kv: float) -> float:
        return (self.base + self.per_prefill_token * prefill + self.per_seq * seqs
                + self.per_kv_token * kv)  # fmt: skip


@dataclass(slots=True)
class Load:
    """What a pool serves: request rate (per worker when asked of a model), mean prompt
    and output lengths in tokens."""

    rate: float
    isl: float
    osl: float


class StepModel:
    """Step time against tokens, for one pool, over the last ``window`` samples."""

    def __init__(self, window: int = 4000, chunk_tokens: int = 2048,
                 quantile: float = 0.9) -> None:  # fmt: skip
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._seen: dict[str, float] = {}  # worker -> last step number taken
        self.coef: Coefficients | None = None
        self.r2 = 0.0
        self.quantile = quantile  # of the ITL the targets are at
        self.default_chunk = chunk_tokens
        self.max_prefill = 0  # the most prompt tokens seen in one step: the engine's chunk
        # what the API observed over what the model said, for TTFT and ITL (see
        # :meth:`calibrate`); every estimate the model gives is multiplied by them
        self.ttft_scale = 1.0
        self.itl_scale = 1.0

    @property
    def chunk_tokens(self) -> int:
        return self.max_prefill or self.default_chunk

    # ----------------------------------------------------------------------------------
    def add(self, worker_id: str, samples: list[list[float]]) -> list[list[float]]:
        """Take a worker's reported steps not taken before; returns those."""
        last = self._seen.get(worker_id, -1.0)
        new = []
        for s in samples:
            if len(s) < 5 or s[0] <= last:
                continue
            _, wall, prefill, seqs, kv = s[:5]
            if wall <= 0:
                continue
            self.samples.append((wall, prefill, seqs, kv))
            self.max_prefill = max(self.max_prefill, int(prefill))
            last = s[0]
            new.append(s)
        self._seen[worker_id] = last
        return new

    def forget(self, live: set[str]) -> None:
        """Drop the step numbers of workers that left (a restarted worker counts anew)."""
        for w in [w for w in self._seen if w not in live]:
            del self._seen[w]

    def fit(self) -> Coefficients | None:
        """Least squares with non-negative coefficients: a step never gets cheaper for
        more work. A quantity that barely varies over the window (a batch that stayed the
        same size) cannot be told apart from the fixed part: it is left out and the fixed
        part takes its cost, until the samples vary. A column whose coefficient comes out
        negative is dropped and the rest refitted. ``None`` until :data:`MIN_SAMPLES`."""
        if len(self.samples) < MIN_SAMPLES:
            return self.coef
        a = np.asarray(self.samples, dtype=np.float64)
        y, x = a[:, 0], np.column_stack([np.ones(len(a)), a[:, 1], a[:, 2], a[:, 3]])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of like size
        xs = x / scale
        cols = [0] + [j for j in (1, 2, 3) if x[:, j].std() > VARIES * max(x[:, j].mean(), 1e-12)]
        beta = np.zeros(4)
        while True:
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (sol >= 0).all() or cols == [0]:
                beta[cols] = np.maximum(sol, 0.0)
                break
            cols = [c for c, v in zip(cols, sol, strict=True) if v >= 0 or c == 0]
        beta /= scale
        pred = x @ beta
        var = float(((y - y.mean()) ** 2).sum())
        self.r2 = 1.0 - float(((y - pred) ** 2).sum()) / var if var > 0 else 1.0
        self.coef = Coefficients(*(float(b) for b in beta))
        return self.coef

    def calibrate(self, load: Load, workers: int, prefill: bool, decode: bool,
                  ttft: float | None, itl: float | None) -> None:  # fmt: skip
        """Move the scales toward what the API observed (``ttft``/``itl``, at the model's
        quantile) over what the model says a pool of ``workers`` gives at ``load``. The
        step fit is exact for the engine, but a request's TTFT also holds the API's and
        the pipeline's time, prompts vary in length, and the router is not a perfect
        least-loaded queue: the scales take up that difference, so that the pool the
        model sizes is the pool that meets the targets. Each reading moves a scale by
        :data:`CALIBRATE_WEIGHT` of the way, within :data:`SCALE_BOUNDS` (they only ever
        make the model more cautious)."""
        if self.coef is None or load.rate <= 0 or workers < 1:
            return
        raw = self._steady(load.rate, load, prefill, decode, workers)
        if raw is None:  # the model says it cannot keep up: no ratio to take
            return
        lo, hi = SCALE_BOUNDS
        if prefill and ttft and raw[0] > 0:
            ratio = min(hi, max(lo, ttft / raw[0]))
            self.ttft_scale += CALIBRATE_WEIGHT * (ratio - self.ttft_scale)
        if decode and itl and raw[1] > 0:
            ratio = min(hi, max(lo, itl / raw[1]))
            self.itl_scale += CALIBRATE_WEIGHT * (ratio - self.itl_scale)

    # ----------------------------------------------------------------------------------
    def itl(self, seqs: float, kv: float, prefill_per_step: float = 0.0) -> float | None:
        """A decode step's time with ``seqs`` sequences reading ``kv`` KV tokens and
        ``prefill_per_step`` prompt tokens chunked in beside them."""
        c = self.coef
        return None if c is None else c.step(prefill_per_step, seqs, kv) * self.itl_scale

    def ttft(self, queued_tokens: float, seqs: float, kv: float) -> float | None:
        """Time until a request whose prompt is the last of ``queued_tokens`` prompt
        tokens gets its first token: the prompt work in chunks of at most
        ``chunk_tokens`` a step, each step also carrying the running decode batch."""
        c = self.coef
        if c is None:
            return None
        steps = max(1, math.ceil(queued_tokens / max(1, self.chunk_tokens)))
        raw = steps * c.step(0.0, seqs, kv) + c.per_prefill_token * queued_tokens
        return raw * self.ttft_scale

    def capacity(self, load: Load, ttft_target: float, itl_target: float,
                 prefill: bool = True, decode: bool = True,
                 workers: int = 1) -> float | None:  # fmt: skip
        """The highest request rate per worker that a pool of ``workers`` sustains with
        its TTFT and ITL quantiles within the targets. ``prefill``/``decode``: which work
        the pool does (a prefill pool computes prompts and one token, a decode pool only
        decodes, the aggregated one both). ``None`` before a fit."""
        if self.coef is None:
            return None

        def meets(rate: float) -> bool:
            s = self.steady(rate * workers, load, prefill, decode, workers)
            return s is not None and s[0] <= ttft_target and s[1] <= itl_target

        lo, hi = 0.0, 1.0
        while meets(hi) and hi < 1e6:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        return lo

    def workers_for(self, load: Load, ttft_target: float, itl_target: float,
                    prefill: bool = True, decode: bool = True,
                    most: int = 1024) -> int | None:  # fmt: skip
        """The fewest workers whose pool serves ``load.rate`` within both targets
        (``most`` + 1 when even ``most`` cannot; ``None`` before a fit). A target under
        what one request alone gets (its own prefill on an idle worker, the bare step)
        is out of reach at any size: it counts as that figure plus 5%, since more
        workers would not bring it closer."""
        if self.coef is None:
            return None
        alone = self.steady(0.0, load, prefill, decode, 1)
        if alone is not None:
            ttft_target = max(ttft_target, alone[0] * 1.05)
            itl_target = max(itl_target, alone[1] * 1.05)
        for n in range(1, most + 1):
            s = self.steady(load.rate, load, prefill, decode, n)
            if s is not None and s[0] <= ttft_target and s[1] <= itl_target:
                return n
        return most + 1

    def steady(self, rate: float, load: Load, prefill: bool = True, decode: bool = True,
               workers: int = 1) -> tuple[float, float] | None:  # fmt: skip
        """(TTFT, ITL), both at the model's quantile, that a pool of ``workers`` settles
        at with ``rate`` requests/s (all of them) of ``load``'s shape, spread evenly;
        ``None`` when it cannot keep up (a queue grows without bound).

        Per worker, the decode batch and the step time feed each other (Little: the batch
        is the rate times a request's decode time); iterated to the fixed point. A prompt
        is served by its worker's prefill slot: its chunks, one a step, each step also
        carrying the batch. Arrivals are random (Poisson) and the router sends each to
        the least loaded worker, so the prompts queue as at ``workers`` servers: the
        wait's quantile from Erlang's C formula (M/M/c), scaled to service times that
        vary less than exponential ones (Allen-Cunneen). Both answers are multiplied by
        the calibrated scales."""
        raw = self._steady(rate, load, prefill, decode, workers)
        return None if raw is None else (raw[0] * self.ttft_scale, raw[1] * self.itl_scale)

    def _steady(self, rate: float, load: Load, prefill: bool, decode: bool,
                workers: int) -> tuple[float, float] | None:  # fmt: skip
        """:meth:`steady` as the step fit alone says it (no calibration)."""
        c = self.coef
        if c is None or workers < 1:
            return None
        r = rate / workers
        pf_tokens = r * load.isl if prefill else 0.0  # prompt tokens per second a worker
        util = c.per_prefill_token * pf_tokens  # the share of its time computing prompts
        if util >= 1.0:
            return None
        itl, seqs = c.base, 0.0
        if decode:
            for _ in range(100):
                seqs = r * load.osl * itl
                nxt = c.step(0.0, seqs, seqs * (load.isl + load.osl / 2)) / (1.0 - util)
                if nxt > 60.0:
                    return None
                done = abs(nxt - itl) < 1e-6
                itl = nxt
                if done:
                    break
            kv_each = load.isl + load.osl / 2
            if r * load.osl * itl * (c.per_seq + c.per_kv_token * kv_each) >= 1:
                return None  # the batch's own growth outruns the step: no fixed point
        decode_only = c.step(0.0, seqs, seqs * (load.isl + load.osl / 2))
        if not prefill:
            return 0.0, decode_only
        # a step's token budget is shared: the next prompt fills what the last one's
        # final chunk leaves, so a prompt takes isl / chunk steps of the prefill slot (a
        # fraction, not rounded up), and its own first token comes after the step under
        # way when it arrives and its own chunks
        chunks = load.isl / max(1, self.chunk_tokens)
        chunk = min(load.isl, self.chunk_tokens)
        mixed = decode_only + c.per_prefill_token * chunk  # a step carrying a chunk
        service = chunks * mixed  # the prompt's time in its worker's prefill slot
        offered = rate * service  # Erlang: busy prefill slots on average
        if offered >= workers:
            return None
        # M/M/c's wait scaled to random arrivals and near-constant service times (Allen
        # and Cunneen: x (ca^2 + cs^2) / 2, Poisson ca^2 = 1; prompts vary: cs^2 = 1/4)
        wait = _wait_quantile(workers, offered, service, self.quantile) * (1 + SERVICE_CV2) / 2
        # ITL at the quantile: once steps carrying a chunk are more than 1 - q of all
        # steps, the quantile is theirs (chunked prefill sets it, whatever the batch)
        share = min(1.0, r * max(1.0, chunks) * itl)
        itl_q = mixed if (decode and share > 1.0 - self.quantile) else decode_only
        return (chunks + 1) * mixed + wait, (itl_q if decode else 0.0)


def _wait_quantile(servers: int, offered: float, service: float, q: float) -> float:
    """The ``q`` quantile of the wait in an M/M/c queue with ``offered`` = arrival rate x
    mean service (Erlang C: the chance to wait, then an exponential wait of rate
    ``(servers - offered) / service``)."""
    # Erlang B by its recurrence, then C from B (stable for any number of servers)
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    p_wait = b / (1.0 - (offered / servers) * (1.0 - b))
    if p_wait <= 1.0 - q:
        return 0.0
    return math.log(p_wait / (1.0 - q)) * service / (servers - offered)
