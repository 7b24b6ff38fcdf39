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
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ]:
        with pytest.raises(OpenAIError) as e:
            unsupported(ChatCompletionRequest(**base, **patch))
        assert e.value.status == 400 and e.value.param == param
    for patch, param in [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:  # 0 only with echo
        with pytest.raises(OpenAIError) as e:
            unsupported(CompletionRequest(model="m", prompt="x", **patch))
        assert e.value.status == 400 and e.value.param == param
    unsupported(ChatCompletionRequest(**base))  # plain request passes
    unsupported(CompletionRequest(model="m", prompt="x", echo=True, logprobs=2))
    unsupported(CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0))
    unsupported(ChatCompletionRequest(**base, echo=True))  # served (vLLM's meaning)


def test_chat_echo_is_the_last_assistant_message() -> None:
    def req(*messages: dict, echo: bool = True) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", messages=list(messages), echo=echo)

    user = {"role": "user", "content": "Hi"}
    assert req(user).echoed() is None  # the last message is not the answer's role
    assert req(user, {"role": "assistant", "content": "Sure,"}).echoed() == "Sure,"
    assert req(user, {"role": "assistant", "content": "Sure,"}, echo=False).echoed() is None
    parts = {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                              {"type": "text", "text": "B"}]}  # fmt: skip
    assert req(user, parts).echoed() == "AB"


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
    assert pb.completion_prompts("Hello world") == [("Hello world", hf("Hello world").input_ids)]


def test_completion_prompts_one_or_a_batch(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir)
    ids = pb.completion_prompts("Hello")[0][1]
    assert pb.completion_prompts(ids) == [(ids, ids)]  # token ids: one prompt
    assert pb.completion_prompts(["Hello"]) == [("Hello", ids)]  # a batch of one
    assert pb.completion_prompts(["Hello", "Hi there"]) == [
        ("Hello", ids), ("Hi there", pb.completion_prompts("Hi there")[0][1])]  # fmt: skip
    assert pb.completion_prompts([[5, 6], [7]]) == [([5, 6], [5, 6]), ([7], [7])]
    for bad, says in [([], "prompt must not be empty"), ("", "prompt must not be empty"),
                      (["a", ""], "prompt 1 must not be empty"),
                      ([[1], []], "prompt 1 must not be empty"),
                      ([[1], [pb.vocab_size]], f"token id {pb.vocab_size} in prompt 1"),
                      (["a"] * 2049, "at most 2048 prompts")]:  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            pb.completion_prompts(bad)  # type: ignore[arg-type]
        assert e.value.status == 400 and e.value.param == "prompt", bad
        assert says in e.value.message, (says, e.value.message)


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


def test_truncated_keeps_the_last_tokens(tiny_model_dir: Path) -> None:
    from api.tokenization import ImageInput, Prompt

    pb = PromptBuilder(tiny_model_dir, max_model_len=100)
    p = Prompt(list(range(10)))
    assert pb.truncated(p, None) is p and pb.truncated(p, 20) is p
    assert pb.truncated(p, 4).token_ids == [6, 7, 8, 9]
    assert pb.truncated(p, -1) is p  # the context window: nothing to cut here
    img = Prompt(list(range(10)), [ImageInput("data:x", "p")], [5], 3)
    kept = pb.truncated(img, 6)
    assert (kept.token_ids, kept.image_offsets) == ([4, 5, 6, 7, 8, 9], [1])
    for bad in (3, 101, 0):  # through the image; beyond the window; nothing
        with pytest.raises(OpenAIError) as e:
            pb.truncated(img, bad)
        assert e.value.param == "truncate_prompt_tokens"
    # vLLM's truncation_side right: the first tokens; an image must fit in them whole
    assert pb.truncated(p, 4, "right").token_ids == [0, 1, 2, 3]
    assert pb.truncated(p, 4, "left").token_ids == [6, 7, 8, 9]
    kept = pb.truncated(img, 8, "right")
    assert (kept.token_ids, kept.image_offsets) == (list(range(8)), [5])
    with pytest.raises(OpenAIError) as e:
        pb.truncated(img, 7, "right")  # placeholders 5..7: the last one cut
    assert e.value.param == "truncate_prompt_tokens"


def test_reasoning_effort_reaches_the_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) are the template's
    reasoning_effort variable, unless chat_template_kwargs set it."""
    import json
    import shutil

    from api.responses import ResponsesRequest, chat_request

    for f in ("tokenizer.json", "config.json"):
        shutil.copy(tiny_model_dir / f, tmp_path / f)
    tmpl = (
        "effort={{ reasoning_effort or 'unset' }};"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl}))
    pb = PromptBuilder(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]

    def rendered(req: ChatCompletionRequest) -> str:
        ids = pb.chat_prompt(req.messages, template_kwargs=req.template_kwargs()).token_ids
        return pb.tokenizer.decode(ids)

    base = ChatCompletionRequest(model="m", messages=msgs)  # type: ignore[arg-type]
    assert "effort=unset;" in rendered(base)
    low = ChatCompletionRequest(model="m", messages=msgs, reasoning_effort="low")  # type: ignore[arg-type]
    assert "effort=low;" in rendered(low)
    mine = ChatCompletionRequest(model="m", messages=msgs, reasoning_effort="low",  # type: ignore[arg-type]
                                 chat_template_kwargs={"reasoning_effort": "high"})  # fmt: skip
    assert "effort=high;" in rendered(mine)
    resp = chat_request(ResponsesRequest(model="m", input="hi", reasoning={"effort": "medium"}))
    assert "effort=medium;" in rendered(resp)
    with pytest.raises(OpenAIError) as e:
        chat_request(ResponsesRequest(model="m", input="hi", reasoning={"effort": "max"}))
    assert e.value.param == "reasoning.effort"
