"""The mock engine: the real scheduler, block pool and KV events with simulated time.

Timing is checked through the engine's simulated-seconds account (the sum of the step-time
model over the steps it ran), never through wall-clock assertions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbm.protocol import Sampling, block_hashes, model_namespace
from tasks.settings import engine_config
from workers.engine_api import EngineRequest, RequestOutput
from workers.mock_engine import MockEngine, MockTiming

FAST = MockTiming(prefill_us_per_token=100, decode_step_ms=2, decode_ms_per_seq=0.5,
                  speedup=1000)  # fmt: skip


def make(model_dir: Path, timing: MockTiming = FAST, **kw: object) -> MockEngine:
    cfg = engine_config(**{"num_kv_blocks": 256, "namespace": "tiny-llava", **kw})  # type: ignore[arg-type]
    return MockEngine.from_model_dir(model_dir, cfg, timing)


def run(engine: MockEngine, *reqs: EngineRequest) -> dict[str, list[RequestOutput]]:
    for r in reqs:
        assert engine.add_request(r) is None
    out: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    return out


def req(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> EngineRequest:
    return EngineRequest(rid, prompt, Sampling(max_tokens=max_tokens, temperature=0, **kw))  # type: ignore[arg-type]


PROMPT = [(i * 37) % 400 + 50 for i in range(100)]


def test_step_time_model() -> None:
    t = MockTiming(prefill_us_per_token=100, prefill_quadratic_us=10, decode_step_ms=5,
                   decode_ms_per_seq=0.5, speedup=2)  # fmt: skip
    assert t.step_seconds(0, []) == 0
    assert t.step_seconds(1, []) == pytest.approx(0.0025)
    # 3 sequences, one of them prefilling 512 tokens of a 1024-token context
    ms = 5 + 0.5 * 2 + 0.1 * 512 + 0.01 * 512 * 1024 / 1024
    assert t.step_seconds(3, [(512, 1024)]) == pytest.approx(ms / 1000 / 2)
    with pytest.raises(ValueError, match="speedup"):
        MockTiming(speedup=0)


def test_placeholder_tokens_length_and_usage(tiny_model_dir: Path) -> None:
    e = make(tiny_model_dir)
    outs = run(e, req("a", PROMPT, max_tokens=12))["a"]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 12
    text = "".join(o.text for o in outs)
    assert text.startswith(" lorem ipsum")
    assert outs[-1].num_prompt_tokens == 100 and outs[-1].num_cached_tokens == 0
    assert e.stats().blocks_used == 0  # every block back


def test_stop_strings_apply_as_in_the_reference_engine(tiny_model_dir: Path) -> None:
    e = make(tiny_model_dir)
    outs = run(e, req("a", PROMPT, max_tokens=40, stop=["dolor"]))["a"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "dolor"
    assert "".join(o.text for o in outs) == " lorem ipsum "


def test_prefix_hit_skips_prefill_time_and_reports_cached_tokens(tiny_model_dir: Path) -> None:
    e = make(tiny_model_dir)
    run(e, req("cold", PROMPT, max_tokens=1))
    cold = e.simulated_seconds
    warm_out = run(e, req("warm", PROMPT, max_tokens=1))["warm"][-1]
    warm = e.simulated_seconds - cold
    assert warm_out.num_cached_tokens == 96  # 6 full blocks; the last token is recomputed
    # cold: one step with 100 prompt tokens; warm: one step with 4
    assert cold == pytest.approx((2 + 0.1 * 100) / 1000 / 1000)
    assert warm == pytest.approx((2 + 0.1 * 4) / 1000 / 1000)


def test_kv_events_carry_the_hashes_the_api_computes(tiny_model_dir: Path) -> None:
    e = make(tiny_model_dir)
    run(e, req("a", PROMPT, max_tokens=1))
    stored = [h for ev in e.take_kv_events() if ev.kind == "stored" for h in ev.block_hashes]
    api_side = block_hashes(PROMPT, 16, model_namespace("tiny-llava"))
    assert stored == api_side  # 6 full prompt blocks, same ids in the same order


def test_batched_decode_time_grows_with_the_batch(tiny_model_dir: Path) -> None:
    one = make(tiny_model_dir)
    run(one, req("a", PROMPT[:16], max_tokens=9))
    four = make(tiny_model_dir)
    run(four, *(req(f"r{i}", PROMPT[i : i + 16], max_tokens=9) for i in range(4)))
    # same number of steps (prefill + 8 decode steps), each with 4 sequences, 3 x 0.5 ms more
    steps = 9
    extra = steps * 3 * 0.5 / 1000 / 1000 + 3 * 16 * 0.1 / 1000 / 1000
    assert four.simulated_seconds - one.simulated_seconds == pytest.approx(extra)


def test_mock_engine_process_does_not_import_torch(tiny_model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path;"
        "from tasks.settings import engine_config;"
        "from workers.mock_engine import MockEngine, MockTiming;"
        "import workers.engine_loop, workers.engine_proc, workers.runtime, tasks.stages;"
        f"MockEngine.from_model_dir(Path({str(tiny_model_dir)!r}), engine_config(), MockTiming());"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _first_token_steps(engine: MockEngine, *reqs: EngineRequest) -> dict[str, int]:
    """The step in which each request's first token came out."""
    for r in reqs:
        assert engine.add_request(r) is None
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished:
        step += 1
        for o in engine.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = step
    return first


def test_priority_orders_the_waiting_queue(tiny_model_dir: Path) -> None:
    """One sequence at a time: the waiting ones start by priority (vLLM's: lower first),
    equal ones in arrival order; all at 0 is first come, first served."""
    e = make(tiny_model_dir, max_num_seqs=1)
    reqs = [req("low-a", PROMPT, 2), req("low-b", PROMPT[:50], 2),
            req("high", PROMPT[:60], 2), req("mid", PROMPT[:70], 2)]  # fmt: skip
    reqs[0].priority = reqs[1].priority = 5
    reqs[2].priority, reqs[3].priority = -1, 0
    first = _first_token_steps(e, *reqs)
    assert sorted(first, key=first.__getitem__) == ["high", "mid", "low-a", "low-b"]
    fifo = _first_token_steps(make(tiny_model_dir, max_num_seqs=1),
                              *(req(f"r{i}", PROMPT[: 40 + i], 2) for i in range(4)))  # fmt: skip
    assert sorted(fifo, key=fifo.__getitem__) == ["r0", "r1", "r2", "r3"]


def test_the_preempted_sequence_is_the_lowest_priority(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """KV blocks for two long sequences but not three: the one preempted (and recomputed)
    is the highest value's, though admitted first; with equal priorities it is the most
    recently admitted (vLLM's recompute policy). Every request still gets its tokens."""
    for low_priority, victim in ((9, "low"), (0, "b")):
        e = make(tiny_model_dir, num_kv_blocks=20, block_size=16, max_model_len=320)
        low, a, b = (req(r, PROMPT[:40], 100, ignore_eos=True) for r in ("low", "a", "b"))
        low.priority = low_priority
        caplog.clear()
        with caplog.at_level("INFO", logger="workers.scheduler"):
            outs = run(e, low, a, b)
        preempted = {m.split()[1] for m in caplog.messages if m.startswith("preempted ")}
        assert e.stats().preemptions > 0 and preempted == {victim}, caplog.messages
        for rid in ("low", "a", "b"):
            assert sum(len(o.token_ids) for o in outs[rid]) == 100


def test_a_full_batch_makes_room_for_a_more_urgent_request(tiny_model_dir: Path) -> None:
    """One sequence at a time, a long low-priority one running: a high-priority request
    that arrives preempts it at the next step (it is recomputed afterwards); both end
    with all their tokens. Equal priorities wait their turn."""
    for high_priority, first_done in ((-1, "high"), (0, "low")):
        e = make(tiny_model_dir, max_num_seqs=1)
        low = req("low", PROMPT[:40], 30, ignore_eos=True)
        assert e.add_request(low) is None
        done, tokens = [], {"low": 0, "high": 0}
        for _ in range(5):  # low is running
            for o in e.step():
                tokens[o.request_id] += len(o.token_ids)
        high = req("high", PROMPT[:50], 3, ignore_eos=True)
        high.priority = high_priority
        assert e.add_request(high) is None
        while e.has_unfinished:
            for o in e.step():
                tokens[o.request_id] += len(o.token_ids)
                if o.finished:
                    done.append(o.request_id)
        assert done[0] == first_done and tokens == {"low": 30, "high": 3}, (done, tokens)
        assert (e.stats().preemptions > 0) == (high_priority < 0)


def _admitted_per_step(engine: MockEngine) -> list[list[str]]:
    """Run to the end; per step, the requests whose first token came out in it."""
    steps, seen = [], set()
    while engine.has_unfinished:
        new = [o.request_id for o in engine.step() if o.token_ids and o.request_id not in seen]
        seen.update(new)
        steps.append(new)
    return steps


def test_a_step_prefills_one_priority_and_a_batch_prompt_alone_beside_urgent_work(
    tiny_model_dir: Path,
) -> None:
    """Prompts of different priorities go in separate steps; while a more urgent sequence
    runs, a worse priority's prompts come in one a step. All equal: one step for all."""
    e = make(tiny_model_dir, max_num_seqs=8)
    online = req("online", PROMPT[:30], 20, ignore_eos=True)
    assert e.add_request(online) is None
    e.step()  # online is running (decoding)
    batch = [req(f"b{i}", PROMPT[i : i + 20], 2, ignore_eos=True) for i in range(3)]
    late = req("late", PROMPT[:25], 2, ignore_eos=True)
    for r in batch:
        r.priority = 100
        assert e.add_request(r) is None
    assert e.add_request(late) is None  # priority 0: ahead of the batch in the queue
    steps = [[r for r in s if r != "online"] for s in _admitted_per_step(e)]
    assert [s for s in steps if s] == [["late"], ["b0"], ["b1"], ["b2"]], steps
    # the same prompts at one priority start together
    e = make(tiny_model_dir, max_num_seqs=8)
    assert e.add_request(req("online", PROMPT[:30], 20, ignore_eos=True)) is None
    e.step()
    for r in [req(f"b{i}", PROMPT[i : i + 20], 2, ignore_eos=True) for i in range(3)]:
        assert e.add_request(r) is None
    steps = [[r for r in s if r != "online"] for s in _admitted_per_step(e)]
    assert [s for s in steps if s] == [["b0", "b1", "b2"]], steps


def test_decode_reads_its_context_every_step() -> None:
    t = MockTiming(prefill_us_per_token=100, decode_step_ms=5, decode_ms_per_seq=0.5,
                   decode_us_per_kv_token=0.1, speedup=2)  # fmt: skip
    # 4 sequences decoding, 3000 tokens of context between them
    ms = 5 + 0.5 * 3 + 0.1 * 3000 / 1000
    assert t.step_seconds(4, [], 3000) == pytest.approx(ms / 1000 / 2)
    with pytest.raises(ValueError, match="decode_us_per_kv_token"):
        MockTiming(decode_us_per_kv_token=-1)


def test_the_h100_llama8b_profile() -> None:
    t = MockTiming.profile("h100-llama8b")
    assert t.step_seconds(1, [], 1000) == pytest.approx((6.0 + 0.05 * 1000 / 1000) / 1000)
    # a full batch of 64 at 2k context: the KV read adds ~6.6 ms to the weights' 6 ms
    assert t.step_seconds(64, [], 64 * 2048) == pytest.approx(
        (6.0 + 0.03 * 63 + 0.05 * 64 * 2048 / 1000) / 1000)  # fmt: skip
    # a 2048-token prompt alone: 60 µs a token and attention over its context
    assert t.step_seconds(1, [(2048, 2048)]) == pytest.approx(
        (6.0 + 0.06 * 2048 + 0.0013 * 2048 * 2048 / 1024) / 1000)  # fmt: skip
    assert MockTiming.profile("h100-llama8b", speedup=4).step_seconds(1, []) == \
        pytest.approx(0.006 / 4)  # fmt: skip
    with pytest.raises(ValueError, match="h100-llama8b"):
        MockTiming.profile("a100")


def test_a_profile_in_the_settings_yields_to_the_fields_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tasks.settings import MockTimingSettings, Settings

    s = MockTimingSettings(profile="h100-llama8b", decode_step_ms=7)
    assert MockTiming(**s.model_dump()) == MockTiming.profile("h100-llama8b", decode_step_ms=7)
    monkeypatch.setenv("CONVEYOR_MOCK__PROFILE", "h100-llama8b")
    monkeypatch.setenv("CONVEYOR_MOCK__SPEEDUP", "10")
    assert MockTiming(**Settings().mock.model_dump()) == MockTiming.profile("h100-llama8b",
                                                                           speedup=10)  # fmt: skip
    assert MockTiming(**MockTimingSettings().model_dump()) == MockTiming()  # same defaults
    with pytest.raises(ValueError, match="h100-llama8b"):
        MockTimingSettings(profile="a100")


def test_steps_count_prefill_decode_and_the_kv_read(tiny_model_dir: Path) -> None:
    timing = MockTiming(prefill_us_per_token=100, decode_step_ms=2, decode_us_per_kv_token=10,
                        speedup=1000)  # fmt: skip
    e = make(tiny_model_dir, timing)
    run(e, req("a", PROMPT, max_tokens=8))
    st = e.stats()
    # one prefill step (100 tokens, the first token), then 7 steps decoding one sequence
    # whose context is 101 .. 107 tokens
    kv = sum(range(101, 108))
    assert (st.steps, st.decode_tokens, st.decode_kv_tokens) == (8, 8, kv)
    assert st.prompt_tokens_computed == 100
    want_ms = 8 * 2 + 0.1 * 100 + 0.01 * kv
    assert e.simulated_seconds == pytest.approx(want_ms / 1000 / 1000)
    c = e.step_counts
    assert c is not None and (c.step_no, c.prefill_tokens, c.decode_seqs,
                              c.decode_kv_tokens) == (8, 0, 1, 107)  # fmt: skip


def test_the_loop_samples_the_last_steps_with_their_wall_time(tiny_model_dir: Path) -> None:
    import threading

    from cluster.membership import HeartbeatReport
    from cluster.stats import STEP_SAMPLES
    from workers.engine_loop import EngineLoop

    done = threading.Event()

    def sink(outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            done.set()

    loop = EngineLoop(make(tiny_model_dir), sink).start()
    try:
        assert loop.stats().step_samples == []  # no step yet
        loop.submit(req("a", PROMPT, max_tokens=40))
        assert done.wait(30)
        st = loop.stats()
    finally:
        loop.stop()
    samples = st.step_samples
    assert st.steps == 40 and len(samples) == STEP_SAMPLES
    # the newest 32 steps, oldest first: decoding one sequence over a growing context
    assert [s[0] for s in samples] == list(range(40 - STEP_SAMPLES + 1, 41))
    assert all(s[2:] == [0, 1, 100 + s[0] - 1] for s in samples)
    assert all(0 < s[1] < 5 for s in samples)
    assert sum(s[1] for s in samples) <= st.step_seconds + 0.001  # (rounded to ms)
    # through the heartbeat's JSON, as the planner reads it
    rep = HeartbeatReport.decode(HeartbeatReport("w", "generate", stats=st).encode())
    assert rep.stats.step_samples == samples and rep.stats.decode_kv_tokens == st.decode_kv_tokens


def test_a_finished_request_reports_its_time_in_the_engine(tiny_model_dir: Path) -> None:
    """Its trace's stage span reads these (workers.runtime): the queue wait, the first token
    (from arrival), preemptions. One sequence at a time: b waits for all of a."""
    e = make(tiny_model_dir, max_num_seqs=1)
    outs = run(e, req("a", PROMPT, max_tokens=6), req("b", PROMPT[:40], max_tokens=6))
    a, b = outs["a"][-1].timing, outs["b"][-1].timing
    assert a is not None and b is not None
    assert all(o.timing is None for o in outs["a"][:-1])  # the last output carries it
    assert a.queued_s is not None and a.first_token_s is not None
    assert 0 <= a.queued_s <= a.first_token_s and a.preemptions == 0
    assert b.queued_s is not None and b.first_token_s is not None
    assert b.queued_s >= a.first_token_s and b.first_token_s >= b.queued_s
