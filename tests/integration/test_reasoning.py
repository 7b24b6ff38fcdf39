"""A reasoning model's thinking split from its answer (``CONVEYOR_REASONING_PARSER``),
through the official client: an API process with the deepseek_r1 parser beside the
session cluster's (which has none) on the same workers, so the same greedy request gives
the same text on both and the split can be checked against the whole.

The tiny model never writes ``</think>`` by itself: a thinking budget ends its thinking,
and a grammar (structured outputs, a forced tool choice) shapes the answer after it; left
free, it never closes its thinking, so all of its output is reasoning, as vLLM's
deepseek_r1 parser reads it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest

from tests.integration.conftest import Cluster, base_env, start_api

pytestmark = pytest.mark.integration

ANSWER = r"[A-Z][a-z]{2,6}"
MSGS = [{"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def reasoning(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    env = base_env(cluster.redis_url, cluster.model_dir, CONVEYOR_REASONING_PARSER="deepseek_r1")
    api, url = start_api("api-reasoning", env, tmp_path_factory.mktemp("reasoning"))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    api.stop()


def _chat(client: openai.OpenAI, model: str, **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model=model, messages=MSGS, temperature=0,  # type: ignore[arg-type]
                                          **kw)  # fmt: skip


def _chat_ids(model_dir: object) -> list[int]:
    """MSGS rendered by HF's chat template, as the API renders them."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=True)  # fmt: skip
    return ids if isinstance(ids, list) else ids["input_ids"]


def _ids(
    client: openai.OpenAI, model: str, prompt: list[int], n: int, **extra: object
) -> list[int]:
    """A greedy completion's token ids."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                          **extra})  # fmt: skip
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]  # type: ignore[union-attr]


def test_thinking_then_a_constrained_answer(cluster: Cluster, reasoning: openai.OpenAI) -> None:
    """A grammar applies after the thinking, as vLLM applies it with a reasoning parser:
    the model thinks unconstrained (its own greedy tokens) until its end of thinking (here
    forced by a thinking budget: the tiny model never writes one), then answers in the
    grammar. The answer equals the grammar's greedy continuation of all of it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(cluster.model_dir / "tokenizer.json"))
    end = tok.encode("</think>", add_special_tokens=False).ids
    whole = cluster.client(max_retries=0)
    prompt = _chat_ids(cluster.model_dir)
    thought = _ids(whole, cluster.model_name, prompt, 4)
    answer = _ids(whole, cluster.model_name, prompt + thought + end, 20,
                  structured_outputs={"regex": ANSWER})  # fmt: skip
    want = tok.decode(answer)  # (its end-of-sequence token is special)
    assert re.fullmatch(ANSWER, want)
    kw = {"max_tokens": 120, "extra_body": {"structured_outputs": {"regex": ANSWER},
                                            "thinking_token_budget": 4}}  # fmt: skip
    split = _chat(reasoning, cluster.model_name, **kw).choices[0]
    assert split.finish_reason == "stop"
    assert (split.message.model_extra["reasoning"], split.message.content) == (  # type: ignore[index]
        tok.decode(thought),
        want,
    )
    assert split.message.model_extra["reasoning_content"] == tok.decode(thought)  # type: ignore[index]

    # streamed: the reasoning deltas, then the content's, the same text
    chunks = list(_chat(reasoning, cluster.model_name, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought_text = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    said = "".join(d.content or "" for d in deltas)
    assert (thought_text, said) == (tok.decode(thought), want)
    firsts = [i for i, d in enumerate(deltas) if d.content]
    lasts = [i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning")]
    assert max(lasts) < min(firsts)

    # include_reasoning: false (vLLM's) drops it
    kw["extra_body"]["include_reasoning"] = False  # type: ignore[index]
    dropped = _chat(reasoning, cluster.model_name, **kw).choices[0].message
    assert dropped.content == want and "reasoning" not in (dropped.model_extra or {})

    # without its end of thinking the grammar never starts: all of it is reasoning
    free = _chat(reasoning, cluster.model_name, max_tokens=10,
                 extra_body={"structured_outputs": {"regex": ANSWER}}).choices[0]  # fmt: skip
    assert free.finish_reason == "length" and free.message.content == ""
    assert free.message.model_extra["reasoning"] == tok.decode(  # type: ignore[index]
        _ids(whole, cluster.model_name, prompt, 10)
    )


def test_unclosed_thinking_is_all_reasoning(cluster: Cluster, reasoning: openai.OpenAI) -> None:
    whole = cluster.client(max_retries=0)
    text = _chat(whole, cluster.model_name, max_tokens=8).choices[0].message.content
    assert text and "</think>" not in text
    split = _chat(reasoning, cluster.model_name, max_tokens=8).choices[0]
    assert split.message.content == "" and split.message.model_extra["reasoning"] == text  # type: ignore[index]
    assert split.finish_reason == "length"

    # the Responses API: the reasoning item alone (it ran out of tokens while thinking, as
    # an OpenAI response can)
    r = reasoning.responses.create(model=cluster.model_name, input="Is the sky blue?",
                                   max_output_tokens=8, temperature=0, store=False)  # fmt: skip
    plain = whole.responses.create(model=cluster.model_name, input="Is the sky blue?",
                                   max_output_tokens=8, temperature=0, store=False)  # fmt: skip
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
    assert r.output[0].content[0].text == plain.output_text  # type: ignore[union-attr, index]
    assert r.output_text == ""
    ask = {
        "model": cluster.model_name,
        "input": "Is the sky blue?",
        "max_output_tokens": 8,
        "temperature": 0,
        "store": False,
    }
    with reasoning.responses.stream(**ask) as s:  # type: ignore[arg-type]
        deltas = [e.delta for e in s if e.type == "response.reasoning_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == plain.output_text
    assert final.output[0].model_dump() == r.output[0].model_dump() | {"id": final.output[0].id}


def test_thinking_then_a_tool_call(cluster: Cluster, reasoning: openai.OpenAI) -> None:
    """A forced tool choice thinks first too: the thinking is reasoning, the call after
    it a call, streamed and not."""
    from tests.integration.test_tools_api import TOOLS, same_calls, streamed, whole

    kw = dict(model=cluster.model_name, messages=MSGS, tools=TOOLS, max_tokens=300,
              temperature=0, tool_choice="required",
              extra_body={"thinking_token_budget": 3})  # fmt: skip
    resp = reasoning.chat.completions.create(**kw)  # type: ignore[call-overload]
    got = whole(resp)
    assert resp.choices[0].finish_reason == "tool_calls" and not got["content"]
    assert got["calls"] and all(c["name"] in ("get_weather", "take_note") for c in got["calls"])
    assert all(isinstance(json.loads(c["arguments"]), dict) for c in got["calls"])
    # the thinking: the first tokens of the same prompt (tools rendered) left free
    plain = cluster.client(max_retries=0).chat.completions.create(
        model=cluster.model_name, messages=MSGS, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
        max_tokens=3, temperature=0)  # fmt: skip
    assert resp.choices[0].message.model_extra["reasoning"] == plain.choices[0].message.content  # type: ignore[index]
    msg, reason = streamed(reasoning, **kw)
    assert same_calls(msg, got) and reason == "tool_calls"


def test_messages_api_thinking_blocks(cluster: Cluster, reasoning: openai.OpenAI) -> None:
    """Anthropic's Messages API on the same API process: the thinking is a ``thinking``
    block before the ``text`` block, streamed and not, as chat splits it."""
    import anthropic

    kw = {"max_tokens": 120, "extra_body": {"structured_outputs": {"regex": ANSWER},
                                            "thinking_token_budget": 4}}  # fmt: skip
    split = _chat(reasoning, cluster.model_name, **kw).choices[0].message
    assert split.model_extra["reasoning"] and split.content  # type: ignore[index]
    c = anthropic.Anthropic(base_url=str(reasoning.base_url).removesuffix("/v1/"),
                            api_key="x", max_retries=0)  # fmt: skip
    a_kw = dict(model=cluster.model_name, max_tokens=120, messages=MSGS,
                thinking={"type": "enabled", "budget_tokens": 4},
                extra_body={"temperature": 0, "structured_outputs": {"regex": ANSWER}})  # fmt: skip
    msg = c.messages.create(**a_kw)  # type: ignore[call-overload]
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == split.model_extra["reasoning"]  # type: ignore[union-attr, index]
    assert msg.content[1].text == split.content  # type: ignore[union-attr]
    with c.messages.stream(**a_kw) as s:  # type: ignore[call-overload]
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert final.model_dump(exclude={"id", "usage"}) == msg.model_dump(exclude={"id", "usage"})
    assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas)
                                            if d == "thinking_delta")  # fmt: skip


def test_thinking_token_budget_forces_the_end(cluster: Cluster, reasoning: openai.OpenAI) -> None:
    """vLLM's thinking_token_budget on the reference engine: a prompt that opens <think>
    (as DeepSeek-R1's template does) gets ``budget`` thinking tokens, HF's greedy ones,
    then ``</think>`` forced, then HF's greedy continuation of all that: the answer."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from tests.integration.test_openai_api import hf_greedy

    tok = AutoTokenizer.from_pretrained(cluster.model_dir)
    hf = (tok, LlavaForConditionalGeneration.from_pretrained(cluster.model_dir).eval())
    start = tok("<think>", add_special_tokens=False).input_ids
    end = tok("</think>", add_special_tokens=False).input_ids
    prompt = tok("Is the sky blue?").input_ids + start
    n, budget = 14, 4

    def ids(**extra: object) -> list[int]:
        r = reasoning.completions.create(
            model=cluster.model_name, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                        **extra})  # fmt: skip
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]  # type: ignore[union-attr]

    free = hf_greedy(hf, prompt, n)
    assert end[0] not in free  # the tiny model never closes its thinking by itself
    assert ids() == free
    thought = free[:budget]
    answer = hf_greedy(hf, prompt + thought + end, n - budget - len(end))
    assert ids(thinking_token_budget=budget) == thought + end + answer
    assert ids(thinking_token_budget=0) == end + hf_greedy(hf, prompt + end, n - len(end))
    assert ids(thinking_token_budget=n) == free  # never reached
    # chat, whose template opens no <think>: the parser reads the output as thinking from
    # its first token, and the budget counts from there; its tokens are the reasoning
    chat_ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    if not isinstance(chat_ids, list):
        chat_ids = chat_ids["input_ids"]
    msg = reasoning.chat.completions.create(
        model=cluster.model_name, messages=MSGS, max_tokens=n, temperature=0,  # type: ignore[arg-type]
        extra_body={"thinking_token_budget": budget, "ignore_eos": True},
    ).choices[0].message  # fmt: skip
    thought = hf_greedy(hf, chat_ids, budget)
    answer = hf_greedy(hf, chat_ids + thought + end, n - budget - len(end))
    assert msg.model_extra["reasoning"] == tok.decode(thought)  # type: ignore[index]
    assert msg.content == tok.decode(answer, skip_special_tokens=True)
    # Anthropic's thinking.budget_tokens is the same budget (as vLLM maps it)
    import anthropic

    c = anthropic.Anthropic(base_url=str(reasoning.base_url).removesuffix("/v1/"),
                            api_key="x", max_retries=0)  # fmt: skip
    m = c.messages.create(model=cluster.model_name, max_tokens=n, messages=MSGS,  # type: ignore[arg-type]
                          thinking={"type": "enabled", "budget_tokens": budget},
                          extra_body={"temperature": 0})  # fmt: skip
    assert m.content[0].thinking == msg.model_extra["reasoning"]  # type: ignore[union-attr, index]
    assert msg.content.startswith(m.content[1].text)  # type: ignore[union-attr]
    # bad input: a negative budget, a budget with a grammar
    with pytest.raises(openai.BadRequestError) as e:
        reasoning.completions.create(model=cluster.model_name, prompt="x", max_tokens=2,
                                     extra_body={"thinking_token_budget": -1})  # fmt: skip
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        reasoning.completions.create(
            model=cluster.model_name, prompt="x", max_tokens=2,
            extra_body={"thinking_token_budget": 2,
                        "structured_outputs": {"regex": "a+"}})  # fmt: skip
    assert e.value.body["param"] == "thinking_token_budget"  # type: ignore[index]


def test_thinking_token_budget_needs_markers(cluster: Cluster) -> None:
    """Without a reasoning parser or CONVEYOR_REASONING_CONFIG there is nothing to count
    between: vLLM's 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client(max_retries=0).completions.create(
            model=cluster.model_name, prompt="x", max_tokens=2,
            extra_body={"thinking_token_budget": 2})  # fmt: skip
    assert e.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
    assert "CONVEYOR_REASONING_PARSER" in e.value.body["message"]  # type: ignore[index]
