"""Tools, tool calls, tool results and vLLM's rendering fields through the chat template
(api/tokenization.py): the same ids Hugging Face's apply_chat_template gives for the same
messages (tool-call arguments as objects, as vLLM hands them to templates)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.errors import OpenAIError
from api.protocol import ChatMessage
from api.tokenization import PromptBuilder
from workers.model_init import TOOLS_PREAMBLE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time, «UTC»"}},
]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
]


def for_hf(msgs: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to a template: arguments as objects."""
    out = []
    for m in msgs:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"] or "{}"),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_ids(hf, msgs: list[dict], **kw: object) -> list[int]:  # type: ignore[no-untyped-def]
    out = hf.apply_chat_template(for_hf(msgs), tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("msgs", [ROUND_TRIP, ROUND_TRIP[1:], ROUND_TRIP[:2]])
def test_tools_and_calls_render_as_transformers(hf, tiny_model_dir: Path, msgs) -> None:  # type: ignore[no-untyped-def]
    pb = PromptBuilder(tiny_model_dir)
    got = pb.chat_prompt([ChatMessage(**m) for m in msgs], TOOLS).token_ids
    assert got == hf_ids(hf, msgs, tools=TOOLS, add_generation_prompt=True)
    text = pb.tokenizer.decode(got, skip_special_tokens=False)
    assert TOOLS_PREAMBLE.strip() in text and '"name": "now"' in text
    # without tools the calls and results still render (a history from another turn)
    got = pb.chat_prompt([ChatMessage(**m) for m in msgs]).token_ids
    assert got == hf_ids(hf, msgs, add_generation_prompt=True)


def test_rendering_fields(hf, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    pb = PromptBuilder(tiny_model_dir)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon "}]
    cm = [ChatMessage(**m) for m in msgs]
    assert pb.chat_prompt(cm, add_generation_prompt=False).token_ids == hf_ids(
        hf, msgs, add_generation_prompt=False
    )
    cont = pb.chat_prompt(cm, add_generation_prompt=False, continue_final_message=True)
    assert cont.token_ids == hf_ids(hf, msgs, continue_final_message=True)
    assert pb.tokenizer.decode(cont.token_ids).endswith("<|assistant|>\nOnce upon ")
    # a template variable the request sets: our template reads bos_token
    kw = pb.chat_prompt(cm, template_kwargs={"bos_token": ""}).token_ids
    assert kw == hf_ids(hf, msgs, add_generation_prompt=True, bos_token="")
    assert kw == pb.chat_prompt(cm).token_ids[1:]


def test_rendering_refusals(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir)
    bad_args = ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
        ],
    )
    image_only = ChatMessage(
        role="user",
        content=[{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    )
    cases = [
        (lambda: pb.chat_prompt([bad_args]), "messages.0.tool_calls.0.function.arguments"),
        (
            lambda: pb.chat_prompt(
                [ChatMessage(role="user", content="x")], template_kwargs={"messages": []}
            ),
            "chat_template_kwargs",
        ),
        (
            lambda: pb.chat_prompt(
                [image_only], add_generation_prompt=False, continue_final_message=True
            ),
            "continue_final_message",
        ),
    ]
    for call, param in cases:
        with pytest.raises(OpenAIError) as e:
            call()
        assert e.value.status == 400 and e.value.param == param


RAG_TEMPLATE = (
    "{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_documents_and_a_requests_own_template(hf, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's documents reach the template as transformers' documents do; a request's own
    chat_template renders as transformers renders it, once the server trusts them."""
    pb = PromptBuilder(tiny_model_dir)
    msgs = [{"role": "user", "content": "What is cached?"}]
    cm = [ChatMessage(**m) for m in msgs]
    docs = [{"title": "KV", "text": "Blocks of sixteen tokens."}, {"title": "B", "text": "x"}]
    with pytest.raises(OpenAIError) as e:
        pb.chat_prompt(cm, chat_template=RAG_TEMPLATE)
    assert e.value.param == "chat_template" and "TRUST_REQUEST_CHAT_TEMPLATE" in e.value.message
    pb.trust_request_templates = True
    got = pb.chat_prompt(cm, documents=docs, chat_template=RAG_TEMPLATE).token_ids
    assert got == hf_ids(hf, msgs, documents=docs, chat_template=RAG_TEMPLATE,
                         add_generation_prompt=True)  # fmt: skip
    assert pb.tokenizer.decode(got).startswith("[KV] Blocks of sixteen tokens.\n[B] x\n<user>")
    # the model's own template again for the next request; add_special_tokens adds a BOS
    plain = pb.chat_prompt(cm).token_ids
    assert plain == hf_ids(hf, msgs, add_generation_prompt=True)
    bos = pb.tokenizer.token_to_id(pb.special["bos_token"])
    assert pb.chat_prompt(cm, add_special_tokens=True).token_ids == [bos, *plain]
    with pytest.raises(OpenAIError) as e:
        pb.chat_prompt(cm, chat_template="{% for m in messages %}")
    assert e.value.param == "chat_template"
