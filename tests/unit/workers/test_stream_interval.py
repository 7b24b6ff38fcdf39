"""The stream interval (workers.stream_interval) through the frame publisher: a request's
first token alone, then a frame per N tokens, the last with its finish; concatenated, the
same tokens, text and logprobs as a frame per token; held tokens flushed on finish, abort,
error and stop; seq numbers contiguous. The publisher's Redis write is captured (the
frames it would send); everything before it is the real code."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis

from kvbm.protocol import FRAMES_OPEN_TTL_S, Sampling, TokenFrame
from tasks.settings import engine_config
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.stream import FramePublisher, StockFramePublisher
from workers.stream_interval import IntervalBuffer, merge


def _capturing(cls: type[FramePublisher]) -> type[FramePublisher]:
    """``cls`` with its Redis write replaced by a list of what it would write: per write,
    its frames (with their request ids) and its log commands."""

    class Captured(cls):  # type: ignore[valid-type, misc]
        def _next(self, request_id: str, finished: bool) -> tuple[int, bytes]:
            self.numbered.append(request_id)  # one per frame, in the write's order
            return super()._next(request_id, finished)

        def _send_frames(self, items, logs=None) -> bool:
            rids, self.numbered = self.numbered, []
            frames = [TokenFrame.decode(f) for _, f in items]
            self.sent.append((list(zip(rids, frames, strict=True)), list(logs or ())))
            return True

    return Captured


def _publisher(interval: int, cls: type[FramePublisher] = FramePublisher, **kw) -> FramePublisher:
    pub = _capturing(cls)(redis.Redis(host="127.0.0.1", port=1), stream_interval=interval, **kw)
    pub.sent, pub.numbered = [], []
    return pub


def _frames(pub: FramePublisher, rid: str | None = None) -> list[TokenFrame]:
    """The frames written so far (``rid``'s only, if given), in order."""
    return [f for w, _ in pub.sent for r, f in w if rid is None or r == rid]


def _lp(tok: int) -> list:
    return [-0.1 * tok, 1, []]


def _outputs(rid: str, k: int, reason: str = "length") -> list[RequestOutput]:
    """A request's k one-token outputs as an engine makes them, the last finished."""
    outs = []
    for i in range(k):
        o = RequestOutput(rid, [100 + i], f"t{i} ", num_prompt_tokens=3, num_output_tokens=i + 1,
                          logprobs=[_lp(100 + i)])  # fmt: skip
        if i == 0:
            o.prompt_logprobs = [None, _lp(1), _lp(2)]
        outs.append(o)
    outs[-1].finished, outs[-1].finish_reason = True, reason
    return outs


def _run(pub: FramePublisher, outs: list[RequestOutput]) -> list[TokenFrame]:
    for o in outs:  # one engine step each
        pub.publish_outputs([o])
    return _frames(pub)


def _joined(frames: list[TokenFrame]) -> tuple[list[int], str, list]:
    return ([t for f in frames for t in f.token_ids], "".join(f.text for f in frames),
            [lp for f in frames for lp in (f.logprobs or [])])  # fmt: skip


# --- frame counts and contents ------------------------------------------------------------
@pytest.mark.parametrize("cls", [FramePublisher, StockFramePublisher])
@pytest.mark.parametrize("k", [1, 2, 5, 9, 10])
def test_first_token_alone_then_a_frame_per_interval_with_the_same_content(cls, k) -> None:
    base = _run(_publisher(1, cls), _outputs("r", k))
    assert len(base) == k
    for n in (1, 3, 4):
        frames = _run(_publisher(n, cls), _outputs("r", k))
        assert len(frames) == 1 + math.ceil((k - 1) / n)
        assert [f.seq for f in frames] == list(range(len(frames)))
        assert frames[0].token_ids == [100]  # never held
        assert frames[0].prompt_logprobs == [None, _lp(1), _lp(2)]
        assert all(f.prompt_logprobs is None for f in frames[1:])
        assert all(len(f.token_ids) == n for f in frames[1:-1])
        assert [f.done for f in frames] == [False] * (len(frames) - 1) + [True]
        assert _joined(frames) == _joined(base)
        last = frames[-1]
        assert (last.finish_reason, last.usage.completion_tokens) == ("length", k)


def test_streams_are_held_apart_and_a_step_sends_one_write() -> None:
    pub = _publisher(3)
    a, b = _outputs("a", 7), _outputs("b", 4, reason="stop")
    for step in range(7):
        pub.publish_outputs([o[step] for o in (a, b) if step < len(o)])
    # a: t0 | t1 t2 t3 | t4 t5 t6 (finished); b: t0 | t1 t2 t3 (finished)
    assert [f.token_ids for f in _frames(pub, "a")] == [[100], [101, 102, 103], [104, 105, 106]]
    assert [f.token_ids for f in _frames(pub, "b")] == [[100], [101, 102, 103]]
    assert [f.seq for f in _frames(pub, "a")] == [0, 1, 2]
    assert _frames(pub, "b")[-1].finish_reason == "stop"
    assert len(pub.sent) == 3  # steps 0, 3 and 6: nothing to write in the others
    assert pub.frames_published == 5


def test_a_finish_flushes_what_is_held_into_the_terminal_frame() -> None:
    frames = _run(_publisher(4), _outputs("r", 3, reason="stop"))
    assert [f.token_ids for f in frames] == [[100], [101, 102]]
    assert frames[1].done and frames[1].finish_reason == "stop"


def test_an_abort_carries_the_held_tokens_and_ends_the_stream() -> None:
    pub = _publisher(4)
    outs = _outputs("r", 10)[:3]  # t0 sent, t1 t2 held
    abort = RequestOutput("r", [], "", finished=True, finish_reason="abort", num_output_tokens=3)
    frames = _run(pub, [*outs, abort])
    assert [(f.seq, f.token_ids, f.done) for f in frames] == [(0, [100], False),
                                                             (1, [101, 102], True)]  # fmt: skip
    assert frames[1].finish_reason == "abort" and frames[1].text == "t1 t2 "
    assert frames[1].logprobs == [_lp(101), _lp(102)]


def test_an_error_carries_the_held_tokens_and_ends_the_stream() -> None:
    pub = _publisher(4)
    _run(pub, _outputs("r", 10)[:2])
    pub.publish_error("r", "the engine failed", "engine_error")
    frames = _frames(pub)
    assert [(f.seq, f.token_ids) for f in frames] == [(0, [100]), (1, [101])]
    assert frames[1].done and frames[1].error.code == "engine_error"
    pub.publish_outputs(_outputs("r", 2)[:1])  # a new stream of the same id starts at 0
    assert _frames(pub)[-1].seq == 0


def test_stop_sends_what_is_held() -> None:
    pub = _publisher(4)
    _run(pub, _outputs("a", 10)[:3] + _outputs("b", 10)[:2])
    assert [f.token_ids for f in _frames(pub)] == [[100], [100]]
    pub.stop()
    flushed = pub.sent[-1][0]
    assert sorted((r, f.seq, f.token_ids, f.done) for r, f in flushed) == [
        ("a", 1, [101, 102], False), ("b", 1, [101], False)]  # fmt: skip
    assert pub.frames_published == 4


def test_a_continued_stream_holds_from_its_first_output() -> None:
    """A decode worker (P/D) or a migration's new worker continues a stream another
    began: its first output is not the stream's first token, so it may wait."""
    pub = _publisher(3)
    pub.start_at("r", 1)
    outs = _outputs("r", 6)[1:]  # t1..t5, the last finished
    frames = _run(pub, outs)
    assert [(f.seq, f.token_ids) for f in frames] == [(1, [101, 102, 103]), (2, [104, 105])]


def test_prefilled_and_embedding_outputs_are_never_held() -> None:
    pub = _publisher(4)
    pub.start_at("p", 0)  # even where its stream counts as opened
    pre = RequestOutput("p", [7], "x", prefilled=True, kv_block_ids=[1])
    emb = RequestOutput("e", [], "", finished=True, finish_reason="stop", embedding="AAAA")
    frames = _run(pub, [pre, emb])
    assert [(f.token_ids, f.done, f.embedding) for f in frames] == [([7], False, None),
                                                                   ([], True, "AAAA")]  # fmt: skip


def test_every_output_reaches_on_published_held_or_not() -> None:
    seen: list[str] = []
    pub = _publisher(4, on_published=lambda outs: seen.extend(o.text for o in outs))
    outs = _outputs("r", 6)
    _run(pub, outs)
    assert seen == [o.text for o in outs]


def test_the_frame_log_holds_the_frames_sent() -> None:
    pub = _publisher(3, log_ttl_s=30.0)
    _run(pub, _outputs("r", 5))
    frames = [f.encode() for f in _frames(pub)]
    logs = [c for _, cs in pub.sent for c in cs]
    assert [c[-1] for c in logs if c[0] == "XADD"] == frames
    assert [c[2] for c in logs if c[0] == "EXPIRE"] == [FRAMES_OPEN_TTL_S, 30]


def test_merge_keeps_logprobs_one_per_token() -> None:
    a = RequestOutput("r", [1, 2], "ab")
    b = RequestOutput("r", [3], "c", logprobs=[_lp(3)], finished=True, finish_reason="stop")
    m = merge([a, b])
    assert (m.token_ids, m.text, m.logprobs, m.finish_reason) == (
        [1, 2, 3], "abc", [None, None, _lp(3)], "stop")  # fmt: skip
    assert merge([a]) is a


def test_an_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        IntervalBuffer(0)


# --- the reference engine: the same greedy output at any interval -------------------------
PROMPT = [1] + [5 + j * 37 % 507 for j in range(11)]


def _engine_frames(model_dir: Path, interval: int,
                   requests: dict[str, Sampling]) -> dict[str, list[TokenFrame]]:  # fmt: skip
    """Run ``requests`` (one prompt) together on a fresh reference engine, its outputs
    published step by step; each request's frames."""
    engine = Engine.from_model_dir(model_dir, engine_config(num_kv_blocks=64, max_model_len=256))
    pub = _publisher(interval)
    for rid, params in requests.items():
        assert engine.add_request(EngineRequest(rid, PROMPT, params)) is None
    while engine.has_unfinished:
        pub.publish_outputs(engine.step())
    assert pub._interval is None or len(pub._interval) == 0, "nothing held once all ended"
    return {rid: _frames(pub, rid) for rid in requests}


def _ending(frames: list[TokenFrame]) -> tuple:
    last = frames[-1]
    return last.finish_reason, last.stop_reason, last.usage


def test_greedy_output_is_the_same_at_interval_1_and_4(tiny_model_dir: Path) -> None:
    greedy = Sampling(temperature=0, max_tokens=13, ignore_eos=True)
    base = _engine_frames(tiny_model_dir, 1, {"len": greedy})["len"]
    assert len(base) == 13
    # a stop string that ends the output mid-buffer: the text of a token (once none of
    # it came earlier) that is neither the first nor a multiple of 4 after it
    stop = None
    for k in range(2, 13):
        text = base[k].text.strip()
        if (k % 4) != 0 and text and text not in "".join(f.text for f in base[:k]):
            stop = text
            break
    assert stop is not None, "no token text to stop on in the tiny model's output"
    requests = {
        "len": greedy,  # max_tokens: 1 + 4 + 4 + 4 tokens
        "odd": Sampling(temperature=0, max_tokens=10, ignore_eos=True),  # 1 + 4 + 4 + 1
        "stop": Sampling(temperature=0, max_tokens=13, ignore_eos=True, stop=[stop]),
        "logprobs": Sampling(
            temperature=0, max_tokens=7, ignore_eos=True, logprobs=2, prompt_logprobs=1
        ),
    }
    one = _engine_frames(tiny_model_dir, 1, requests)
    four = _engine_frames(tiny_model_dir, 4, requests)
    assert one["len"] == base
    assert one["stop"][-1].finish_reason == "stop" and len(one["stop"]) % 4 != 1
    for rid in requests:
        n = sum(len(f.token_ids) for f in one[rid])
        assert len(one[rid]) == n, rid
        assert len(four[rid]) == 1 + math.ceil((n - 1) / 4), rid
        assert _joined(four[rid]) == _joined(one[rid]), rid
        assert _ending(four[rid]) == _ending(one[rid]), rid
        assert [f.seq for f in four[rid]] == list(range(len(four[rid]))), rid
    assert four["logprobs"][0].prompt_logprobs == one["logprobs"][0].prompt_logprobs
    assert four["logprobs"][0].prompt_logprobs is not None
