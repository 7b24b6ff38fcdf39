"""vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids`` through the real pipeline
(the session cluster: redis-server, ``conveyor worker`` processes, the API over HTTP, the
official openai client), as RL and agent frameworks read them: the prompt's ids as the
engine ran them, each choice's output ids, streamed and not, the same; logprobs naming
their tokens by id."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "Count the blocks of the cache."}]
PROMPT = [1, 72, 301, 44, 209, 17, 388, 96, 150, 263]
IDS = {"return_token_ids": True}


def _x(obj: Any) -> dict:
    return obj.model_extra or {}


def _detok(cluster: Cluster, ids: list[int]) -> str:
    r = httpx.post(f"{cluster.url}/detokenize", json={"model": cluster.model_name, "tokens": ids})
    return r.json()["prompt"]


def test_chat_returns_the_prompt_and_output_ids_streamed_and_not(cluster: Cluster) -> None:
    c = cluster.client(max_retries=0)
    kw: dict[str, Any] = {"model": cluster.model_name, "messages": MSGS, "max_tokens": 9,
                          "temperature": 0, "extra_body": IDS}  # fmt: skip
    r = c.chat.completions.create(**kw)
    prompt_ids, out_ids = _x(r)["prompt_token_ids"], _x(r.choices[0])["token_ids"]
    tok = httpx.post(f"{cluster.url}/tokenize",
                     json={"model": cluster.model_name, "messages": MSGS}).json()  # fmt: skip
    assert prompt_ids == tok["tokens"] and len(prompt_ids) == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert len(out_ids) == r.usage.completion_tokens == 9  # type: ignore[union-attr]
    assert _detok(cluster, out_ids) == r.choices[0].message.content

    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert _x(chunks[0])["prompt_token_ids"] == prompt_ids  # the first chunk only
    assert all("prompt_token_ids" not in _x(ch) for ch in chunks[1:])
    streamed = [t for ch in chunks if ch.choices for t in _x(ch.choices[0]).get("token_ids") or []]
    assert streamed == out_ids
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content

    # not asked for: none of it (the plain path)
    plain = c.chat.completions.create(**{**kw, "extra_body": {}})
    assert "prompt_token_ids" not in _x(plain) and "token_ids" not in _x(plain.choices[0])


def test_completions_carry_them_on_each_choice(cluster: Cluster) -> None:
    c = cluster.client(max_retries=0)
    kw: dict[str, Any] = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 7,
                          "temperature": 0.8, "seed": 5, "n": 2, "extra_body": IDS}  # fmt: skip
    r = c.completions.create(**kw)
    assert [_x(ch)["prompt_token_ids"] for ch in r.choices] == [PROMPT, PROMPT]
    outs = {ch.index: _x(ch)["token_ids"] for ch in r.choices}
    assert sum(len(v) for v in outs.values()) == r.usage.completion_tokens  # type: ignore[union-attr]
    for ch in r.choices:
        assert _detok(cluster, outs[ch.index]) == ch.text

    got: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list[int]] = {}
    for chunk in c.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            got[ch.index] += _x(ch).get("token_ids") or []
            if "prompt_token_ids" in _x(ch):
                assert ch.index not in firsts, "the prompt's ids come once per choice"
                firsts[ch.index] = _x(ch)["prompt_token_ids"]
    assert got == outs  # seeded: the same tokens streamed
    assert firsts == {0: PROMPT, 1: PROMPT}


def test_logprobs_name_tokens_by_id(cluster: Cluster) -> None:
    c = cluster.client(max_retries=0)
    body = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = c.chat.completions.create(model=cluster.model_name, messages=MSGS, max_tokens=6,  # type: ignore[call-overload]
                                  temperature=0, logprobs=True, top_logprobs=2,
                                  extra_body=body)  # fmt: skip
    ids = _x(r.choices[0])["token_ids"]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [lp.token for lp in content] == [f"token_id:{t}" for t in ids]
    assert all(lp.bytes == list(lp.token.encode()) for lp in content)
    assert all(t.token.startswith("token_id:") for lp in content for t in lp.top_logprobs)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the likeliest

    cr = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=5,
                              temperature=0, logprobs=1, extra_body=body)  # fmt: skip
    lp = cr.choices[0].logprobs
    assert lp is not None and lp.tokens == [f"token_id:{t}" for t in _x(cr.choices[0])["token_ids"]]
    streamed = [t for ch in c.completions.create(model=cluster.model_name, prompt=PROMPT,
                                                 max_tokens=5, temperature=0, logprobs=1,
                                                 extra_body=body, stream=True)
                for t in (ch.choices[0].logprobs.tokens if ch.choices and ch.choices[0].logprobs
                          else [])]  # fmt: skip
    assert streamed == lp.tokens
    # off (the default): tokens by their text
    plain = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=5,
                                 temperature=0, logprobs=1)  # fmt: skip
    assert plain.choices[0].logprobs.tokens[0] == _detok(cluster, [int(lp.tokens[0][9:])])  # type: ignore[union-attr, index]


def test_a_bad_flag_is_a_400(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client(max_retries=0).chat.completions.create(
            model=cluster.model_name, messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"return_token_ids": "sometimes"},
        )  # fmt: skip
    assert "return_token_ids" in str(e.value)


def test_ids_beside_tool_parsing(cluster: Cluster) -> None:
    """With tools the text goes through the tool-call parser; the ids ride chunks of their
    own, every token once."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    c = cluster.client(max_retries=0)
    kw: dict[str, Any] = {"model": cluster.model_name, "messages": MSGS, "max_tokens": 8,
                          "temperature": 0, "tools": tools, "extra_body": IDS}  # fmt: skip
    r = c.chat.completions.create(**kw)
    ids = _x(r.choices[0])["token_ids"]
    assert len(ids) == r.usage.completion_tokens and _x(r)["prompt_token_ids"]  # type: ignore[union-attr]
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert [t for ch in chunks if ch.choices
            for t in _x(ch.choices[0]).get("token_ids") or []] == ids  # fmt: skip
    assert _x(chunks[0])["prompt_token_ids"] == _x(r)["prompt_token_ids"]
