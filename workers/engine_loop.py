"""``EngineLoop``: runs an engine on its own thread.

Other threads (the engine process's command reader, transfer threads) submit and abort
through it; every step's outputs go to a sink callback, and the engine's KV events to an
event sink (called after every step, with or without events). The engine wakes the loop
when a copy it started on another thread has ended (KV onboarded or pulled, an offload
done), so a request waiting for its KV resumes at once and nothing waits on a timer.
Works with any :class:`workers.engine_api.Engine`; torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import cast

from cluster.stats import STEP_SAMPLES, EngineStats
from kvbm.block_pool import KVEvent
from workers.engine_api import Engine, EngineRequest, RequestOutput

log = logging.getLogger(__name__)

OutputSink = Callable[[list[RequestOutput]], None]
# (this step's events, whether the engine is now idle: nothing held back may wait then)
EventSink = Callable[[list[KVEvent], bool], None]


class EngineLoop:
    """Runs an engine on its own thread; thread-safe submit / abort."""

    def __init__(
        self, engine: Engine, sink: OutputSink, name: str = "engine-loop",
        event_sink: EventSink | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self._sink = sink
        self._event_sink = event_sink
        self._inbox: deque[tuple[str, object]] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_seconds_total = 0.0
        # the last steps' (step_no, wall_s, prefill_tokens, decode_seqs, decode_kv_tokens),
        # from the engine's own counts of each step (none: it does not see its steps)
        self.step_samples: deque[tuple[int, float, int, int, int]] = deque(maxlen=STEP_SAMPLES)
        self._counts = engine.step_counts
        self._sampled_no = 0  # the step the latest sample is of
        engine.set_waker(self._wake)
        # an engine that computes elsewhere (vLLM) blocks in step() until outputs come:
        # commands posted to the loop return it from that step at once
        self._engine_wake = getattr(engine, "wake", None)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._engine_wake is not None:
            self._engine_wake()
        self._thread.join(timeout)

    def submit(self, req: EngineRequest) -> None:
        self._post(("add", req))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result in a future."""
        fut: Future = Future()
        self._post(("call", (fn, fut)))
        return fut

    def stats(self) -> EngineStats:
        """The engine's counters and the loop's time spent in steps (read from any thread:
        a snapshot of plain counters, a step may be under way)."""
        st = self.engine.stats()
        st.step_seconds = round(self.step_seconds_total, 3)
        st.step_samples = [[n, round(w, 6), p, d, kv]
                           for n, w, p, d, kv in list(self.step_samples)]  # fmt: skip
        return st

    # ----------------------------------------------------------------------------------
    def _post(self, item: tuple[str, object]) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()
        if self._engine_wake is not None:
            self._engine_wake()

    def _wake(self) -> None:
        """A copy ended, or KV events came (another thread): step soon, to collect it."""
        self._post(("wake", None))

    def _drain(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                assert isinstance(arg, EngineRequest), "an 'add' command carries a request"
                out = self.engine.add_request(arg)
            elif kind == "call":
                fn, fut = cast("tuple[Callable[[Engine], object], Future]", arg)
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - hand it to the caller
                    fut.set_exception(e)
                out = None
            elif kind == "wake":
                out = None  # the step below collects what ended
            else:
                assert isinstance(arg, str), "an 'abort' command carries a request id"
                out = self.engine.abort(arg)
            if out is not None:
                outs.append(out)
        return outs

    def _run(self) -> None:
        while True:
            with self._cv:
                if self.engine.stalled and not self._inbox and not self._stopped:
                    # nothing fits until blocks come back (a release, an expiry, an abort)
                    self._cv.wait(0.05)
                while not self._stopped and not self._inbox and not self.engine.has_unfinished:
                    # with pinned blocks around, wake up now and then to expire them
                    if not self._cv.wait(1.0 if self.engine.has_pinned else None):
                        break
                if self._stopped:
                    return
                outs = self._drain()
                if self.engine.has_pinned:
                    self.engine.expire_pinned(time.monotonic())
            try:
                t0 = time.perf_counter()
                outs.extend(self.engine.step())
                wall = time.perf_counter() - t0
                self.step_seconds_total += wall
                c = self._counts
                if c is not None and c.step_no != self._sampled_no:  # a step was computed
                    self._sampled_no = c.step_no
                    self.step_samples.append((c.step_no, wall, c.prefill_tokens,
                                              c.decode_seqs, c.decode_kv_tokens))  # fmt: skip
            except Exception:  # noqa: BLE001 - the loop must survive to serve others
                log.error("engine step failed:\n%s", traceback.format_exc())
                outs.extend(self.engine.fail_all("internal engine error; see worker log"))
            if outs:
                try:
                    self._sink(outs)
                except Exception:  # noqa: BLE001
                    log.exception("output sink failed")
            events = self.engine.take_kv_events()  # taken even unused: they would pile up
            if self._event_sink is not None:  # every step: it may be holding some back
                try:
                    self._event_sink(events, not self.engine.has_unfinished)
                except Exception:  # noqa: BLE001
                    log.exception("KV event sink failed")
