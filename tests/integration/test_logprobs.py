"""Logprobs and the sampling features through the real pipeline (redis-server, `conveyor
worker` processes, the API over HTTP, the official openai client):

* chat and completions logprobs, and vLLM's prompt_logprobs, equal Hugging Face's
  log_softmax on the same checkpoint within 1e-3 (the tiny default LLaVA, and the
  grouped-query-attention Llama of the parity tests on a deployment of its own);
* streamed chat logprobs reassemble to exactly the non-streamed ones; completions' echo,
  with and without logprobs, streamed and not;
* the sampling fields reach the engine (logit_bias, allowed_token_ids, bad_words,
  include_stop_str_in_output, penalties);
* a mock worker serves include_stop_str_in_output and refuses logprobs and
  prompt_logprobs with a 400 naming the field.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from api.tokenization import PromptBuilder
from tests.integration.conftest import (
    Cluster,
    base_env,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.unit.workers.test_engine_parity import _write_gqa_llama

pytestmark = pytest.mark.integration

TOL = 1e-3
PROMPT = [1, 72, 301, 44, 209, 17, 388, 96, 150, 263, 41, 7, 480, 333, 12, 99, 250, 61, 5]
MESSAGES = [{"role": "user", "content": "Tell me about the cache of sixteen tokens."}]


# ------------------------------------------------------------------------ deployments
@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server for this module's own deployments."""
    p, url = start_redis(tmp_path_factory.mktemp("lp-redis"))
    yield url
    p.stop()


def _deploy(name: str, redis_url: str, model_dir: Path, logdir: Path, **env: str) -> Cluster:
    e = base_env(redis_url, model_dir, **env)
    w = start_worker(f"{name}-w", "generate", f"{name}-w", e, logdir)
    with stop_on_error(w):
        api, url = start_api(f"{name}-api", e, logdir)
    with stop_on_error(w, api):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 90, name, [w, api])
    return Cluster(url, redis_url, model_dir, model_dir.name, [w], api)


@pytest.fixture(scope="module")
def gqa(
    own_redis: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    d = _write_gqa_llama(tmp_path_factory.mktemp("models") / "gqa-llama", tiny_model_dir)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():  # the chat template, for chat requests
            shutil.copy(tiny_model_dir / name, d / name)
    c = _deploy("lp-gqa", own_redis.rsplit("/", 1)[0] + "/1", d, tmp_path_factory.mktemp("lp-gqa"))
    yield c
    for p in (c.api, *c.workers):
        p.stop()


@pytest.fixture(scope="module")
def mock(
    own_redis: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = _deploy(
        "lp-mock",
        own_redis.rsplit("/", 1)[0] + "/2",
        tiny_model_dir,
        tmp_path_factory.mktemp("lp-mock"),
        CONVEYOR_ENGINE="mock",
        CONVEYOR_MOCK__DECODE_STEP_MS="1",
    )
    yield c
    for p in (c.api, *c.workers):
        p.stop()


@pytest.fixture(params=["default", "gqa"])
def deployment(request: pytest.FixtureRequest) -> Cluster:
    return request.getfixturevalue("cluster" if request.param == "default" else "gqa")


def _hf(model_dir: Path) -> torch.nn.Module:
    cfg = json.loads((model_dir / "config.json").read_text())
    cls = (
        transformers.LlavaForConditionalGeneration
        if "vision_config" in cfg
        else transformers.LlamaForCausalLM
    )
    return cls.from_pretrained(model_dir).eval()


def _log_softmax(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        t = torch.tensor([ids])
        out = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


# ------------------------------------------------------------------------- parity
def test_completion_and_prompt_logprobs_equal_hf(deployment: Cluster) -> None:
    hf = _hf(deployment.model_dir)
    builder = PromptBuilder(deployment.model_dir)
    strings = lambda t: builder.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    n = 12
    out_ids = _greedy(hf, PROMPT, n)
    lsm = _log_softmax(hf, PROMPT + out_ids)
    r = deployment.client().completions.create(
        model=deployment.model_name,
        prompt=PROMPT,
        max_tokens=n,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True, "prompt_logprobs": 3},
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp.tokens == [strings(t) for t in out_ids]
    for j, t in enumerate(out_ids):
        row = lsm[len(PROMPT) - 1 + j]
        assert abs(lp.token_logprobs[j] - row[t].item()) < TOL
        # the top 5 by string (tokens that read alike, say U+FFFD, share one key: the
        # likeliest one's), then the sampled token
        want: dict[str, float] = {}
        for i, x in zip(*(v.tolist() for v in row.topk(5)[::-1]), strict=True):
            want.setdefault(strings(i), x)
        got = lp.top_logprobs[j]
        assert list(got)[: len(want)] == list(want)
        assert list(got.values())[: len(want)] == pytest.approx(list(want.values()), abs=TOL)
    # vLLM's prompt_logprobs, on the choice: the prompt's token (with its rank), the top 3
    plps = choice.model_extra["prompt_logprobs"]
    assert len(plps) == len(PROMPT) and plps[0] is None
    for i in range(1, len(PROMPT)):
        row, entry = lsm[i - 1], plps[i]
        mine = entry[str(PROMPT[i])]
        assert abs(mine["logprob"] - row[PROMPT[i]].item()) < TOL
        assert mine["rank"] == int((row > row[PROMPT[i]]).sum()) + 1
        assert mine["decoded_token"] == strings(PROMPT[i])
        for tid in row.topk(3).indices.tolist():
            assert abs(entry[str(tid)]["logprob"] - row[tid].item()) < TOL


def test_chat_logprobs_equal_hf(deployment: Cluster) -> None:
    hf = _hf(deployment.model_dir)
    builder = PromptBuilder(deployment.model_dir)
    from api.protocol import ChatMessage

    prompt = builder.chat_prompt([ChatMessage(**m) for m in MESSAGES]).token_ids
    out_ids = _greedy(hf, prompt, 10)
    lsm = _log_softmax(hf, prompt + out_ids)
    r = deployment.client().chat.completions.create(
        model=deployment.model_name,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True, "prompt_logprobs": 2},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    for j, (t, entry) in enumerate(zip(out_ids, content, strict=True)):
        row = lsm[len(prompt) - 1 + j]
        text = builder.tokenizer.decode([t], skip_special_tokens=False)
        assert entry.token == text and entry.bytes == list(text.encode("utf-8"))
        assert abs(entry.logprob - row[t].item()) < TOL
        top = row.topk(4)
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=TOL
        )
    plps = r.model_extra["prompt_logprobs"]  # vLLM puts chat's on the response
    assert len(plps) == len(prompt) and plps[0] is None
    assert abs(plps[-1][str(prompt[-1])]["logprob"] - lsm[len(prompt) - 2, prompt[-1]].item()) < TOL


def test_streamed_chat_logprobs_reassemble_to_the_non_streamed(cluster: Cluster) -> None:
    """Both runs on one worker, each computing its whole prompt (prompt_logprobs asked:
    no prefix-cache hit), so the numbers are the same computation, bit for bit."""
    client = cluster.client()
    kw: dict[str, Any] = dict(
        model=cluster.model_name,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True, "prompt_logprobs": 0, "worker_id": "itest-w0"},
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in content] == [
        e.model_dump() for e in whole.choices[0].logprobs.content
    ]
    assert len(content) == 24
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "prompt_logprobs" not in chunks[1].model_extra  # not in streams, as in vLLM


def test_completions_echo(cluster: Cluster) -> None:
    client = cluster.client()
    kw: dict[str, Any] = dict(
        model=cluster.model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    plain = client.completions.create(prompt="Once upon a time", **kw)
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kw)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    stream = client.completions.create(prompt="Once upon a time", echo=True, stream=True, **kw)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith("Once upon a time")
    assert "".join(texts) == echoed.choices[0].text
    # with logprobs: the prompt's tokens first (the first has none), then the output's
    lp = client.completions.create(prompt=PROMPT, echo=True, logprobs=2, **kw)
    out = client.completions.create(prompt=PROMPT, logprobs=2, **kw).choices[0].logprobs
    got = lp.choices[0].logprobs
    assert len(got.tokens) == len(PROMPT) + 8
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert all(x is not None for x in got.token_logprobs[1:])
    assert got.tokens[len(PROMPT) :] == out.tokens
    assert got.token_logprobs[len(PROMPT) :] == pytest.approx(out.token_logprobs, abs=TOL)
    chunks = list(
        client.completions.create(prompt=PROMPT, echo=True, logprobs=2, stream=True, **kw)
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == got.tokens


# ------------------------------------------------------------------ sampling fields
def test_sampling_fields_reach_the_engine(cluster: Cluster) -> None:
    client = cluster.client()
    builder = PromptBuilder(cluster.model_dir)
    kw: dict[str, Any] = dict(model=cluster.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    base = client.completions.create(logprobs=3, extra_body={"ignore_eos": True}, **kw)
    first = base.choices[0].logprobs.tokens[0]
    # logit_bias: +100 on a token makes it every token
    tok = builder.tokenizer.encode(" the", add_special_tokens=False).ids[0]
    r = client.completions.create(logit_bias={str(tok): 100}, extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == " the" * 6
    # bad_words: "is" (one token bare, one spaced: both banned, by vLLM's rule) is banned
    # even against a bias on " is"; the model's own first choice comes back
    tok = builder.tokenizer.encode(" is", add_special_tokens=False).ids[0]
    r = client.completions.create(
        logit_bias={str(tok): 100},
        logprobs=3,
        extra_body={"ignore_eos": True, "bad_words": ["is"]},
        **kw,
    )
    assert not {" is", "is"} & set(r.choices[0].logprobs.tokens)
    assert r.choices[0].logprobs.tokens[0] == first
    # allowed_token_ids: only those
    allowed = builder.tokenizer.encode(" a b c", add_special_tokens=False).ids
    r = client.completions.create(
        logprobs=0, extra_body={"ignore_eos": True, "allowed_token_ids": allowed}, **kw
    )
    names = {builder.tokenizer.decode([t], skip_special_tokens=False) for t in allowed}
    assert set(r.choices[0].logprobs.tokens) <= names
    # penalties are served (a different greedy continuation is allowed, not required)
    r = client.completions.create(
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.1},
        **kw,
    )
    assert r.usage.completion_tokens == 6


def test_include_stop_str_in_output(cluster: Cluster) -> None:
    client = cluster.client()
    full = (
        client.completions.create(
            model=cluster.model_name,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    at = next(
        i
        for i in range(5, len(full) - 3)
        if full[i : i + 3].strip() and "\ufffd" not in full[i : i + 3]
    )
    stop = full[at : at + 3]
    for include in (False, True):
        r = client.completions.create(
            model=cluster.model_name,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": include},
        )
        cut = full.index(stop) + (len(stop) if include else 0)
        assert r.choices[0].text == full[:cut]
        assert r.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------- mock worker
def test_a_mock_worker_refuses_logprobs_by_name(mock: Cluster) -> None:
    client = mock.client(max_retries=0)
    cases: list[tuple[dict[str, Any], str, str]] = [
        (dict(logprobs=True), "chat", "logprobs"),
        (dict(extra_body={"prompt_logprobs": 1}), "chat", "prompt_logprobs"),
        (dict(logprobs=2), "completion", "logprobs"),
        (dict(echo=True, extra_body={"prompt_logprobs": 0}), "completion", "prompt_logprobs"),
        (dict(extra_body={"bad_words": ["x"]}), "chat", "bad_words"),
        (dict(extra_body={"allowed_token_ids": [5]}), "completion", "allowed_token_ids"),
    ]
    for kw, kind, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            if kind == "chat":
                client.chat.completions.create(
                    model=mock.model_name, messages=MESSAGES, max_tokens=4, **kw
                )
            else:
                client.completions.create(model=mock.model_name, prompt="hi", max_tokens=4, **kw)
        err = e.value.body
        assert (err["code"], err["param"]) == ("unsupported_parameter", param), (kw, err)


def test_a_mock_worker_serves_stop_strings_with_include_and_ignores_penalties(
    mock: Cluster,
) -> None:
    client = mock.client(max_retries=0)
    kw: dict[str, Any] = dict(model=mock.model_name, prompt="hi", max_tokens=30, stop=["ipsum"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == " lorem " and r.choices[0].finish_reason == "stop"
    r = client.completions.create(extra_body={"include_stop_str_in_output": True}, **kw)
    assert r.choices[0].text == " lorem ipsum"
    # penalties and biases only weigh the choice of a token, which the mock does not make
    r = client.completions.create(
        presence_penalty=1.0,
        logit_bias={"5": 3},
        extra_body={"repetition_penalty": 1.3, "min_p": 0.2},
        **kw,
    )
    assert r.choices[0].text == " lorem "
