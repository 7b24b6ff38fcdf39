"""The Responses API's logprobs (``include: ["message.output_text.logprobs"]`` and
``top_logprobs``) and ``truncation: "auto"``, through the official client on the real
pipeline: the output text's logprobs are the chat completion's for the same conversation
(the same tokens, the same numbers), streamed deltas add up to the whole response's; a
conversation too long for the context window loses its oldest items and reads as the
request that sends only those kept."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

LOGPROBS = ["message.output_text.logprobs"]
TOL = 1e-4


def _entries(lps: list) -> list[tuple[str, float, list[str]]]:
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in lps]


def test_output_text_logprobs_equal_chat_s(cluster: Cluster) -> None:
    client, model = cluster.client(max_retries=0), cluster.model_name
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=10,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    want = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    resp = client.responses.create(model=model, input=msgs, max_output_tokens=10,  # type: ignore[arg-type]
                                   temperature=0, include=LOGPROBS, top_logprobs=2)  # type: ignore[list-item]  # fmt: skip
    assert resp.output_text == chat.choices[0].message.content
    part = resp.output[0].content[0]  # type: ignore[union-attr]
    got = part.logprobs  # type: ignore[union-attr]
    assert [e[0] for e in _entries(got)] == [e.token for e in want]  # type: ignore[union-attr]
    assert [e[1] for e in _entries(got)] == pytest.approx([e.logprob for e in want], abs=TOL)  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 2 for e in got)
    assert resp.top_logprobs == 2
    # streamed: the deltas' entries add up to the whole response's, and so does the done
    deltas, done = [], None
    with client.responses.stream(model=model, input=msgs, max_output_tokens=10,  # type: ignore[arg-type]
                                 temperature=0, include=LOGPROBS, top_logprobs=2) as s:  # type: ignore[list-item]  # fmt: skip
        for ev in s:
            if ev.type == "response.output_text.delta":
                deltas += ev.logprobs
            elif ev.type == "response.output_text.done":
                done = ev.logprobs
    assert done is not None
    assert _entries(deltas) == _entries(got) == _entries(done)
    # without the include, top_logprobs alone adds nothing (vLLM's and OpenAI's rule)
    plain = client.responses.create(model=model, input=msgs, max_output_tokens=4,  # type: ignore[arg-type]
                                    temperature=0, top_logprobs=2)  # fmt: skip
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", include=["no.such.thing"])  # type: ignore[list-item]
    assert e.value.body["param"] == "include.0"  # type: ignore[index]


def test_truncation_auto_drops_the_oldest_items(cluster: Cluster) -> None:
    """Six long turns (about 2,700 tokens) and a question, on a 2,048-token model: with
    truncation disabled a 400; with auto the oldest items go, and the answer is the one
    the request sending only the items kept gets."""
    client, model = cluster.client(max_retries=0), cluster.model_name
    long = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"turn {i}: " + "the waves roll over the sand again " * 60}
            for i in range(6)]  # fmt: skip
    question = {"role": "user", "content": "What did we talk about?"}
    kw = dict(model=model, max_output_tokens=16, temperature=0, instructions="Be brief.")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=[*long, question], **kw)  # type: ignore[arg-type]
    assert e.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    cut = client.responses.create(input=[*long, question], truncation="auto", **kw)  # type: ignore[arg-type]
    assert cut.truncation == "auto" and cut.status in ("completed", "incomplete")
    assert cut.usage.input_tokens + 16 <= 2048  # type: ignore[union-attr]
    kept = next(k for k in range(1, 6)
                if _fits(client, [*long[k:], question], kw))  # the fewest dropped  # fmt: skip
    want = client.responses.create(input=[*long[kept:], question], **kw)  # type: ignore[arg-type]
    assert cut.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert cut.output_text == want.output_text
    # a conversation's stored turns are truncated the same way (they are items too)
    conv = client.conversations.create(items=long)  # type: ignore[arg-type]
    in_conv = client.responses.create(input=[question], conversation=conv.id,
                                      truncation="auto", **kw)  # type: ignore[arg-type]  # fmt: skip
    assert in_conv.output_text == want.output_text


def _fits(client: openai.OpenAI, items: list, kw: dict) -> bool:
    try:
        client.responses.create(input=items, **kw)  # type: ignore[arg-type]
    except openai.BadRequestError:
        return False
    return True


def test_vllms_sampling_extensions_reach_the_model_as_in_chat(cluster: Cluster) -> None:
    """vLLM's Responses API takes chat's sampling fields (penalties, logit_bias, stop,
    stop_token_ids, ignore_eos, structured_outputs, ...): the same greedy text as chat
    with them, and a bad one is a 400 naming it."""
    client, model = cluster.client(max_retries=0), cluster.model_name
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,  # type: ignore[arg-type]
                                           temperature=0).choices[0].message.content  # fmt: skip
    for extra in ({"presence_penalty": 1.5, "frequency_penalty": 1.0, "logit_bias": {"101": 5}},
                  {"stop": [(plain or "xy")[3:5]], "include_stop_str_in_output": True},
                  {"structured_outputs": {"choice": ["calm", "rough"]}},
                  {"ignore_eos": True, "stop_token_ids": [7]}):  # fmt: skip
        chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,  # type: ignore[arg-type]
                                              temperature=0, extra_body=extra)  # fmt: skip
        resp = client.responses.create(model=model, input=msgs, max_output_tokens=12,  # type: ignore[arg-type]
                                       temperature=0, extra_body=extra)  # fmt: skip
        assert resp.output_text == chat.choices[0].message.content, extra
        if "logit_bias" in extra:  # the fields changed the output: they reached the model
            assert resp.output_text != plain
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", extra_body={"stop": ["a"] * 100})
    assert e.value.body["param"] == "stop"  # type: ignore[index]
