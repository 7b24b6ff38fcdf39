"""Request validation and prompt building in the API, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.errors import OpenAIError
from api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, unsupported
from api.tokenization import PromptBuilder


def test_unsupported_parameters_are_named() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for patch, param in [
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"echo": True}, "echo"),  # chat's echo (completions' is served)
    ]:
        with pytest.raises(OpenAIError) as e:
            unsupported(ChatCompletionRequest(**base, **patch))
        assert e.value.status == 400 and e.value.param == param
    for patch, param in [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")]:
        with pytest.raises(OpenAIError) as e:
            unsupported(CompletionRequest(model="m", prompt="x", **patch))
        assert e.value.status == 400 and e.value.param == param
    unsupported(ChatCompletionRequest(**base))  # plain request passes
    unsupported(CompletionRequest(model="m", prompt="x", echo=True, logprobs=2))


def test_schema_bounds() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", temperature=2.5)
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", stop=[""])
    r = CompletionRequest(model="m", prompt="x", stop="END", unknown_field=1)
    assert r.stop_list() == ["END"]


def test_chat_template_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    pb = PromptBuilder(tiny_model_dir)
    msgs = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Héllo 🙂"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Again"},
    ]
    expected = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert pb.chat_ids([ChatMessage(**m) for m in msgs]) == expected
    assert pb.completion_ids("Hello world") == hf("Hello world").input_ids


def test_context_window(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir, max_model_len=100)
    assert pb.check_length(10, None, "prompt") == 90
    assert pb.check_length(10, 90, "prompt") == 90
    with pytest.raises(OpenAIError) as e:
        pb.check_length(10, 91, "prompt")
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(OpenAIError) as e:
        pb.check_length(100, None, "messages")
    assert e.value.param == "messages"
