"""The engine loop's pause and resume (vLLM's ``pause_generation`` modes), on the mock
engine at 5 ms a decode step: what runs, what is held, what ends, and when a pause is
answered."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers.engine_api import EngineRequest, RequestOutput
from workers.engine_loop import EngineLoop
from workers.mock_engine import MockEngine, MockTiming

STEP = MockTiming(prefill_us_per_token=10, decode_step_ms=5, decode_ms_per_seq=0)
PROMPT = [(i * 37) % 400 + 50 for i in range(64)]


class Sink:
    """Every output by request id, and when each request ended."""

    def __init__(self) -> None:
        self.outs: dict[str, list[RequestOutput]] = {}
        self.ended: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, outs: list[RequestOutput]) -> None:
        with self.lock:
            for o in outs:
                self.outs.setdefault(o.request_id, []).append(o)
                if o.finished:
                    self.event(o.request_id).set()

    def event(self, rid: str) -> threading.Event:
        return self.ended.setdefault(rid, threading.Event())

    def tokens(self, rid: str) -> int:
        with self.lock:
            return sum(len(o.token_ids) for o in self.outs.get(rid, []))

    def last(self, rid: str) -> RequestOutput:
        return self.outs[rid][-1]


@pytest.fixture
def loop_and_sink(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    cfg = engine_config(num_kv_blocks=256, namespace="tiny-llava")
    engine = MockEngine.from_model_dir(tiny_model_dir, cfg, STEP)
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    yield loop, sink
    loop.stop()


def req(rid: str, max_tokens: int) -> EngineRequest:
    params = Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return EngineRequest(rid, PROMPT, params)


def wait_tokens(sink: Sink, rid: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while sink.tokens(rid) < n:
        assert time.monotonic() < deadline, f"{rid}: {sink.tokens(rid)} tokens"
        time.sleep(0.005)


def test_keep_freezes_what_runs_and_holds_what_comes(loop_and_sink) -> None:  # type: ignore[no-untyped-def]
    loop, sink = loop_and_sink
    loop.submit(req("a", 200))
    wait_tokens(sink, "a", 5)
    assert loop.pause("keep").result(5) == {"paused": True, "held": 0}
    frozen_at = sink.tokens("a")
    loop.submit(req("b", 10))
    time.sleep(0.3)  # 60 steps' time: nothing moves
    assert sink.tokens("a") == frozen_at and sink.tokens("b") == 0
    assert loop.resume().result(5) == 1  # b joins the engine
    assert sink.event("a").wait(10) and sink.event("b").wait(10)
    assert sink.tokens("a") == 200 and sink.last("a").finish_reason == "length"
    assert sink.tokens("b") == 10


def test_abort_ends_what_runs_then_holds_new_requests(loop_and_sink) -> None:  # type: ignore[no-untyped-def]
    loop, sink = loop_and_sink
    loop.submit(req("a", 500))
    loop.submit(req("b", 500))
    wait_tokens(sink, "a", 3)
    assert loop.pause("abort").result(5) == {"paused": True, "held": 0}
    for rid in ("a", "b"):
        assert sink.event(rid).is_set()
        last = sink.last(rid)
        assert last.finish_reason == "abort" and last.error is None
        assert sink.tokens(rid) < 500
    loop.submit(req("c", 8))
    time.sleep(0.2)
    assert sink.tokens("c") == 0 and not sink.event("c").is_set()
    loop.resume().result(5)
    assert sink.event("c").wait(10) and sink.last("c").finish_reason == "length"


def test_wait_is_answered_once_what_runs_has_finished(loop_and_sink) -> None:  # type: ignore[no-untyped-def]
    loop, sink = loop_and_sink
    loop.submit(req("a", 60))  # ~0.3 s of steps
    wait_tokens(sink, "a", 2)
    paused = loop.pause("wait")
    loop.submit(req("b", 5))
    assert paused.result(10) == {"paused": True, "held": 1}
    # answered only once a ran to its end; b has not started
    assert sink.event("a").is_set() and sink.last("a").finish_reason == "length"
    assert sink.tokens("a") == 60 and sink.tokens("b") == 0
    loop.resume().result(5)
    assert sink.event("b").wait(10) and sink.tokens("b") == 5


def test_a_held_request_can_be_cancelled_and_a_resume_answers_a_pending_wait(
    loop_and_sink,
) -> None:  # type: ignore[no-untyped-def]
    loop, sink = loop_and_sink
    loop.submit(req("a", 400))  # ~2 s of steps
    wait_tokens(sink, "a", 2)
    paused = loop.pause("wait")
    loop.submit(req("held", 5))
    loop.abort("held")  # a client gone while held: it ends at once, as an abort
    assert sink.event("held").wait(5) and sink.last("held").finish_reason == "abort"
    assert sink.last("held").num_prompt_tokens == len(PROMPT)
    # a resume before a drained: the wait is answered "not paused", and a runs on
    assert loop.resume().result(5) == 0
    assert paused.result(5) == {"paused": False, "held": 0}
    assert sink.event("a").wait(10) and sink.tokens("a") == 400


def test_abort_after_keep_ends_what_was_kept(loop_and_sink) -> None:  # type: ignore[no-untyped-def]
    loop, sink = loop_and_sink
    loop.submit(req("a", 300))
    wait_tokens(sink, "a", 2)
    loop.pause("keep").result(5)
    assert not sink.event("a").is_set()
    assert loop.pause("abort").result(5)["paused"] is True
    assert sink.event("a").is_set() and sink.last("a").finish_reason == "abort"
    with pytest.raises(ValueError, match="pause mode 'later'"):
        loop.pause("later")
    loop.resume().result(5)
