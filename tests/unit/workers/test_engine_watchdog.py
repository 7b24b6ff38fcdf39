"""The worker's engine watchdog: what counts as hung, and the engine loop's report of how
long its current round (a step) has run, which the watchdog reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers.engine_api import EngineRequest, RequestOutput
from workers.engine_loop import EngineLoop
from workers.engine_proc import hang
from workers.mock_engine import MockEngine, MockTiming


def test_hung_is_silent_or_one_step_past_the_limit() -> None:
    assert hang(0.2, 0.0, 3.0) is None
    assert hang(2.9, 2.9, 3.0) is None
    assert hang(3.5, 0.0, 3.0) == "no word from it for 3.5s"
    assert hang(0.1, 4.25, 3.0) == "one engine step under way for 4.2s"


def test_the_loop_reports_the_age_of_its_round_and_zero_while_it_waits(
    tiny_model_dir: Path,
) -> None:
    # each decode step takes 400 ms: sampled mid-step, the round is under way
    slow = MockTiming(prefill_us_per_token=1, decode_step_ms=400, decode_ms_per_seq=0)
    cfg = engine_config(num_kv_blocks=256, namespace="tiny-llava")
    done = threading.Event()

    def sink(outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            done.set()

    loop = EngineLoop(MockEngine.from_model_dir(tiny_model_dir, cfg, slow), sink).start()
    try:
        assert loop.stats().loop_busy_s == 0.0  # idle
        params = Sampling(max_tokens=4, temperature=0, ignore_eos=True)
        loop.submit(EngineRequest("a", list(range(5, 40)), params))
        seen = []
        while not done.is_set():
            seen.append(loop.stats().loop_busy_s)
            time.sleep(0.05)
        assert 0.25 < max(seen) < 1.0, seen  # one round at a time, none left to grow
        time.sleep(0.1)
        assert loop.stats().loop_busy_s == 0.0  # waiting again
    finally:
        loop.stop()
