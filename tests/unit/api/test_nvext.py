"""Dynamo's ``nvext`` on chat and completions: its fields mapped onto theirs (a field the
body sets itself wins), GAIE's query-only annotation a 400 naming it; the pins of its
fields and headers, its annotations' SSE events and its timing (api.nvext)."""

from __future__ import annotations

import json

import pytest

from api import nvext
from api.errors import OpenAIError
from api.protocol import ChatCompletionRequest, CompletionRequest, unsupported
from api.runner import RunningRequest
from tasks.modes import get_mode

MSGS = [{"role": "user", "content": "x"}]


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSGS, **kw)


def test_fields_map_onto_their_counterparts() -> None:
    r = chat(temperature=0.9, nvext={
        "greed_sampling": True, "ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1,
        "max_thinking_tokens": 64, "backend_instance_id": 7587, "agent_hints": {"priority": 3},
        "some_future_field": 1,
    })  # fmt: skip
    assert r.temperature == 0.0 and r.ignore_eos and r.top_k == 5
    assert r.repetition_penalty == 1.1 and r.thinking_token_budget == 64
    assert r.worker_id == "7587"  # Dynamo's instance id, as a worker id
    assert r.priority == -3  # Dynamo serves higher first; here lower goes first
    unsupported(r)  # nothing refused
    c = CompletionRequest(model="m", prompt="p", nvext={"decode_worker_id": "w1",
                                                       "backend_instance_id": "w0"})  # fmt: skip
    assert c.worker_id == "w1"


def test_the_bodys_own_fields_win() -> None:
    r = chat(top_k=2, thinking_token_budget=8, worker_id="w", priority=5,
             nvext={"top_k": 9, "max_thinking_tokens": 1, "backend_instance_id": "x",
                    "agent_hints": {"priority": 1}})  # fmt: skip
    assert (r.top_k, r.thinking_token_budget, r.worker_id, r.priority) == (2, 8, "w", 5)
    assert chat(nvext={"greed_sampling": False}).temperature is None


@pytest.mark.parametrize("field", [
    {"use_raw_prompt": True}, {"annotations": ["formatted_prompt", "anything"]},
    {"extra_fields": ["worker_id", "routed_experts"]}, {"prefill_worker_id": 3},
    {"session_control": {"session_id": "s", "action": "open", "timeout": 60}},
])  # fmt: skip
def test_dynamo_fields_are_taken(field: dict) -> None:
    unsupported(chat(nvext=field))


def test_the_gaie_query_only_annotation_is_refused() -> None:
    with pytest.raises(OpenAIError) as e:
        unsupported(chat(nvext={"annotations": ["query_instance_id:abc"]}))
    assert e.value.status == 400 and e.value.param == "nvext.annotations"


def test_pins_from_fields_and_headers() -> None:
    agg, pd = get_mode("agg"), get_mode("ep-d")
    ext = chat(nvext={"prefill_worker_id": "p1"}).nvext
    assert nvext.pins("d1", ext, {}, pd) == ("d1", "p1")
    assert nvext.pins(None, None, {"x-prefill-instance-id": "p2",
                                   "x-worker-instance-id": "d2"}, pd) == ("d2", "p2")  # fmt: skip
    assert nvext.pins("d1", None, {"x-worker-instance-id": "d2"}, pd) == ("d2", None)
    assert nvext.pins(None, None, {"x-conveyor-worker-id": "w"}, agg) == ("w", None)
    # one worker prefills and decodes: the prefill pin is the pin, unless it contradicts it
    assert nvext.pins(None, ext, {}, agg) == ("p1", None)
    assert nvext.pins("p1", ext, {}, agg) == ("p1", None)
    with pytest.raises(OpenAIError) as e:
        nvext.pins("d1", ext, {}, agg)
    assert e.value.param == "nvext.prefill_worker_id"


def test_annotation_events_are_dynamos_sse_events() -> None:
    ext = chat(nvext={"annotations": ["token_ids", "x", "formatted_prompt", "token_ids"]}).nvext
    out = nvext.annotation_events(ext, [1, 2], lambda ids, skip: f"<{ids}|{skip}>").decode()
    events = out.split("\r\n\r\n")
    assert events[-1] == "" and len(events) == 3  # one each, in the order asked
    assert events[0] == 'event: token_ids\r\n: "[1,2]"'
    name, comment = events[1].split("\r\n")
    assert name == "event: formatted_prompt" and json.loads(comment[2:]) == "<[1, 2]|False>"
    assert nvext.annotation_events(None, [1], lambda ids, skip: "") == b""


def test_timing_fields_and_what_is_left_out() -> None:
    run = RunningRequest("r", None, None, started=10.0)  # type: ignore[arg-type]
    run.sent_at, run.first_token_at, run.ended_at, run.kv_hit_rate = 10.002, 10.05, 10.3, 0.5
    t = nvext.timing([run], 10.0, 123)
    assert t == {"request_received_ms": 123, "prefill_wait_time_ms": 2.0,
                 "prefill_time_ms": 48.0, "ttft_ms": 50.0, "total_time_ms": 300.0,
                 "kv_hit_rate": 0.5}  # fmt: skip
    run.first_token_at = run.ended_at = run.kv_hit_rate = None  # not there yet: left out
    assert set(nvext.timing([run], 10.0, 1)) == {"request_received_ms", "prefill_wait_time_ms"}
    ask = chat(nvext={"extra_fields": ["worker_id"]}).nvext
    run.workers = {"prefill_worker_id": "a", "decode_worker_id": "b"}
    build = nvext.response_fields(ask, [run], 10.0)
    assert build is not None and build() == {"worker_id": {"prefill_worker_id": "a",
                                                           "decode_worker_id": "b"}}  # fmt: skip
    assert nvext.response_fields(chat(nvext={"extra_fields": ["other"]}).nvext, [run], 0) is None
