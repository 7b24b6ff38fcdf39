"""``EngineLoop``: runs an engine on its own thread.

Other threads (the engine process's command reader, transfer threads) submit and abort
through it; every step's outputs go to a sink callback, and the engine's KV events to an
event sink (called after every step, with or without events). The engine wakes the loop
when a copy it started on another thread has ended (KV onboarded or pulled, an offload
done), so a request waiting for its KV resumes at once and nothing waits on a timer.
Pausing (vLLM's ``pause_generation``, for a weight update) is the loop's, so every engine
pauses alike: requests that arrive while paused are held here, outside the engine, until
resume; ``keep`` stops stepping, ``wait`` steps until the engine is idle, ``abort`` ends
what the engine holds first (finish reason ``abort``) and then waits for it to be idle.
Works with any :class:`workers.engine_api.Engine`; torch-free.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

from cluster.stats import STEP_SAMPLES, EngineStats
from kvbm.block_pool import KVEvent
from workers.engine_api import Engine, EngineRequest, RequestOutput, aborted

log = logging.getLogger(__name__)

OutputSink = Callable[[list[RequestOutput]], None]
# (this step's events, whether the engine is now idle: nothing held back may wait then)
EventSink = Callable[[list[KVEvent], bool], None]

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode


@dataclass(slots=True)
class _Pausing:
    """A pause asked for: its answer once the engine holds nothing that runs (at once for
    ``keep``), the prefix cache then forgotten if ``clear_cache``."""

    mode: str
    clear_cache: bool
    done: Future


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
        # paused: new requests wait in _held (in arrival order) until resume; frozen: no
        # step at all (``keep``); _pausing: pauses answered once the engine is idle
        self.paused = False
        self._frozen = False
        self._held: dict[str, EngineRequest] = {}
        self._pausing: list[_Pausing] = []
        self._round_started = 0.0  # monotonic start of the round under way; 0: waiting

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

    def pause(self, mode: str, clear_cache: bool = True) -> Future:
        """Pause (vLLM's modes, :data:`PAUSE_MODES`); the future's result, a dict, once
        paused: ``{"paused": True, "held": <requests held>}`` (``False`` if a resume came
        first). Pausing a paused loop again applies the new mode (``abort`` after ``keep``
        ends what was kept)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        fut: Future = Future()
        self._post(("pause", _Pausing(mode, clear_cache, fut)))
        return fut

    def resume(self) -> Future:
        """Resume: the requests held meanwhile join the engine in their arrival order; the
        future's result is how many."""
        fut: Future = Future()
        self._post(("resume", fut))
        return fut

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
        started = self._round_started
        st.loop_busy_s = round(time.monotonic() - started, 3) if started else 0.0
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
                if self.paused:
                    self._held[arg.request_id] = arg
                    continue
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
            elif kind == "pause":
                assert isinstance(arg, _Pausing), "a 'pause' command carries its pausing"
                outs += self._pause(arg)
                out = None
            elif kind == "resume":
                assert isinstance(arg, Future), "a 'resume' command carries its future"
                outs += self._resume(arg)
                out = None
            else:
                assert isinstance(arg, str), "an 'abort' command carries a request id"
                held = self._held.pop(arg, None)
                out = (self.engine.abort(arg) if held is None
                       else aborted(arg, len(held.prompt_token_ids)))  # fmt: skip
            if out is not None:
                outs.append(out)
        return outs

    def _pause(self, p: _Pausing) -> list[RequestOutput]:
        """Apply a pause on the loop's thread; the outputs of the requests it aborted."""
        self.paused = True
        outs: list[RequestOutput] = []
        if p.mode == "abort":
            # every request the engine holds ends now, as an abort; their blocks come back
            # (a KV copy under way ends first: the steps below collect it)
            outs = self.engine.fail_all("aborted by a pause")
            for o in outs:
                o.finish_reason, o.error, o.error_code, o.error_param = "abort", None, None, None
            # prefilled KV waiting for decode workers goes too: its requests are aborted
            # there, or held, and then prefilled again (a failed pull) after the resume
            self.engine.expire_pinned(math.inf)
        self._freeze(p.mode == "keep")
        self._pausing.append(p)
        log.info("paused (%s): %d requests held back so far", p.mode, len(self._held))
        return outs

    def _resume(self, fut: Future) -> list[RequestOutput]:
        """Resume on the loop's thread: held requests join the engine in arrival order."""
        self.paused = False
        self._freeze(False)
        for p in self._pausing:  # a resume before the engine was idle: not paused
            p.done.set_result({"paused": False, "held": len(self._held)})
        self._pausing.clear()
        held, self._held = list(self._held.values()), {}
        outs = [o for req in held if (o := self.engine.add_request(req)) is not None]
        log.info("resumed: %d held requests join the engine", len(held))
        fut.set_result(len(held))
        return outs

    def _freeze(self, frozen: bool) -> None:
        """Stop stepping (``keep``), or step again. An engine that computes elsewhere
        (vLLM) is told too (its ``freeze``/``thaw``): not stepping it only leaves its
        outputs where they are."""
        if frozen != self._frozen:
            hook = getattr(self.engine, "freeze" if frozen else "thaw", None)
            if hook is not None:
                hook()
        self._frozen = frozen

    def _settle_pauses(self) -> None:
        """Answer the pauses waiting for the engine to be idle (all, for ``keep``), with
        the prefix cache forgotten first where asked (the weights are about to change)."""
        if not self._pausing or (not self._frozen and self.engine.has_unfinished):
            return
        if any(p.clear_cache and p.mode != "keep" for p in self._pausing):
            if not self.engine.reset_prefix_cache(True):
                return  # a copy to the tiers below is under way: at a later step
        for p in self._pausing:
            p.done.set_result({"paused": True, "held": len(self._held)})
        self._pausing.clear()

    def _run(self) -> None:
        while True:
            self._round_started = 0.0
            with self._cv:
                if self.engine.stalled and not self._inbox and not self._stopped:
                    # nothing fits until blocks come back (a release, an expiry, an abort)
                    self._cv.wait(0.05)
                while (
                    not self._stopped
                    and not self._inbox
                    and (self._frozen or not self.engine.has_unfinished)
                ):
                    if self._pausing:  # answered below; a clear waiting for a copy: soon
                        self._cv.wait(0.05)
                        break
                    # with pinned blocks around, wake up now and then to expire them
                    if not self._cv.wait(1.0 if self.engine.has_pinned else None):
                        break
                if self._stopped:
                    return
                self._round_started = time.monotonic()
                outs = self._drain()
                if self.engine.has_pinned:
                    self.engine.expire_pinned(time.monotonic())
            if self._frozen:  # paused, ``keep``: what runs stays where it is
                self._settle_pauses()
                self._emit(outs)
                continue
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
            if self._pausing:
                self._settle_pauses()
            self._emit(outs)

    def _emit(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to the sink, and the engine's KV events to theirs."""
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
