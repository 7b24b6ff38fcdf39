"""Dynamo's ``nvext`` on chat and completions: its fields mapped onto theirs (a field the
body sets itself wins), the ones without a counterpart a 400 naming them."""

from __future__ import annotations

import pytest

from api.errors import OpenAIError
from api.protocol import ChatCompletionRequest, CompletionRequest, unsupported

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
    {"use_raw_prompt": True}, {"annotations": ["formatted_prompt"]},
    {"extra_fields": ["worker_id"]}, {"prefill_worker_id": 3},
    {"session_control": {"session_id": "s"}},
])  # fmt: skip
def test_fields_without_a_counterpart_are_refused(field: dict) -> None:
    with pytest.raises(OpenAIError) as e:
        unsupported(chat(nvext=field))
    (name,) = field
    assert e.value.status == 400 and e.value.param == f"nvext.{name}"
