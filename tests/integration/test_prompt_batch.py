"""A batch of prompts in one ``/v1/completions`` request (a list of strings or of token-id
lists, as OpenAI and vLLM take it; lm-evaluation-harness sends its loglikelihood requests
so), through the real pipeline: real redis-server, ``conveyor worker`` processes, the API
over HTTP, the official openai client.

Checked: each prompt's choices equal the same prompt sent alone (greedy), at index
``p * n + j``, streamed and not, with usage summing the prompts; echo with logprobs per
prompt, and echo with ``max_tokens: 0`` (the prompt alone, its logprobs); a batch larger
than its worker's cap runs to its end (each prompt's slots freed as it ends, for the
prompts waiting behind it); a client gone mid-stream frees every prompt; a bad prompt
anywhere in the batch is a 400 before anything runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    base_env,
    one_worker,
    wait_for,
)

pytestmark = pytest.mark.integration

PROMPTS: list[Any] = ["The ships on the sea", "Once upon a time there was", "A cat"]
IDS = [[1] + [7 + (i * 31) % 500 for i in range(k)] for k in (5, 19, 40)]  # token-id prompts
CAP = 3  # requests the capped worker holds at once


def _alone(client: openai.OpenAI, model: str, prompt: Any, **kw: Any) -> Any:
    return client.completions.create(model=model, prompt=prompt, **kw)


def _by_index(chunks: list) -> tuple[dict[int, str], dict[int, str], list]:
    """Per choice index, its streamed text and finish reason; and the usage chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = [c for c in chunks if c.usage is not None]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons, f"choice {c.index} finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("prompts", [PROMPTS, IDS], ids=["strings", "token-ids"])
def test_a_batch_equals_its_prompts_sent_alone(cluster: Cluster, prompts: list) -> None:
    """Greedy, n=2: choice p*2+j is prompt p's output alone; usage sums the prompts (each
    once) and every choice's tokens; the stream carries the same texts, one [DONE]."""
    client = cluster.client(max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    alone = [_alone(client, cluster.model_name, p, **kw) for p in prompts]
    want = [a.choices[0].text for a in alone for _ in range(2)]
    got = client.completions.create(model=cluster.model_name, prompt=prompts, n=2, **kw)
    assert [c.index for c in got.choices] == list(range(2 * len(prompts)))
    assert [c.text for c in got.choices] == want
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert got.usage.completion_tokens == 2 * len(prompts) * 10
    assert got.id.startswith("cmpl-")
    chunks = list(client.completions.create(model=cluster.model_name, prompt=prompts, n=2,
                                            stream=True, stream_options={"include_usage": True},
                                            **kw))  # fmt: skip
    texts, reasons, usage = _by_index(chunks)
    assert [texts[i] for i in range(len(want))] == want
    assert reasons == dict.fromkeys(range(len(want)), "length")
    assert len(usage) == 1 and chunks[-1] is usage[0]
    assert usage[0].usage.prompt_tokens == got.usage.prompt_tokens
    assert usage[0].usage.completion_tokens == got.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_echo_and_logprobs_per_prompt_as_an_eval_harness_sends_them(cluster: Cluster) -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs=1,
    max_tokens=1, greedy. Each choice echoes its own prompt and carries its prompt's
    logprobs (the first token's null) then the output token's, as the prompt alone does."""
    client = cluster.client(max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(max_tokens=1, temperature=0, echo=True, logprobs=1)
    got = client.completions.create(model=cluster.model_name, prompt=IDS, **kw)
    for prompt, choice in zip(IDS, got.choices, strict=True):
        alone = _alone(client, cluster.model_name, prompt, **kw).choices[0]
        lp = choice.logprobs
        assert choice.text == alone.text and lp.tokens == alone.logprobs.tokens
        assert len(lp.tokens) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
        assert lp.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
        assert lp.text_offset == alone.logprobs.text_offset
    # strings: each choice echoes its own prompt as sent
    texts = client.completions.create(model=cluster.model_name, prompt=PROMPTS, max_tokens=3,
                                      temperature=0, echo=True)  # fmt: skip
    assert [c.text[: len(p)] for c, p in zip(texts.choices, PROMPTS, strict=True)] == PROMPTS


def test_echo_with_max_tokens_0_is_the_prompt_alone(cluster: Cluster) -> None:
    """vLLM's echo with max_tokens 0: the prompt's text and logprobs, no output token (the
    one run for the logprobs is dropped): 0 completion tokens, finish reason length; a
    batch, streamed and not. Without echo, max_tokens 0 is a 400."""
    client = cluster.client(max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(temperature=0, echo=True, logprobs=1)
    with_one = client.completions.create(model=cluster.model_name, prompt=IDS[1], max_tokens=1,
                                         **kw).choices[0].logprobs  # fmt: skip
    got = client.completions.create(model=cluster.model_name, prompt=IDS, max_tokens=0, **kw)
    for prompt, choice in zip(IDS, got.choices, strict=True):
        one = _alone(client, cluster.model_name, prompt, max_tokens=1, **kw).choices[0]
        token = _alone(client, cluster.model_name, prompt, max_tokens=1,
                       temperature=0).choices[0].text  # fmt: skip
        assert choice.text + token == one.text  # the echo, without the token
        assert len(choice.logprobs.tokens) == len(prompt) and choice.finish_reason == "length"
    # the prompt's logprobs are those of the same prompt with one token run
    assert got.choices[1].logprobs.token_logprobs == pytest.approx(
        with_one.token_logprobs[:-1], abs=1e-4)  # fmt: skip
    assert got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == sum(len(p) for p in IDS)
    chunks = list(client.completions.create(model=cluster.model_name, prompt=PROMPTS,
                                            max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    texts, reasons, usage = _by_index(chunks)
    assert [texts[i] for i in range(3)] == PROMPTS
    assert reasons == dict.fromkeys(range(3), "length")
    assert usage[0].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=cluster.model_name, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]


def _settled_prompt_tokens(cluster: Cluster) -> dict[str, int]:
    """Each worker's prompt tokens seen, once two heartbeats (0.5 s apart) agree: what
    ran just before is counted, and what would run now would show."""

    def seen() -> dict[str, int]:
        return {w: info["prompt_tokens_seen"] for w, info in cluster.worker_loads().items()}

    last = seen()
    for _ in range(20):
        time.sleep(1.2)
        now = seen()
        if now == last:
            return now
        last = now
    raise AssertionError(f"the workers' prompt token counts never settled: {last}")


def test_a_bad_prompt_anywhere_refuses_the_batch_before_it_runs(cluster: Cluster) -> None:
    """An id out of the vocabulary in the last prompt, an empty one, too long a prompt, too
    many choices: 400 naming the field, and no worker was handed anything."""
    client = cluster.client(max_retries=0, timeout=30)
    r = redis.Redis.from_url(cluster.redis_url)
    before = _settled_prompt_tokens(cluster)  # the tests before this one's work counted
    too_long = [1] * 5000
    cases = [([[1, 2], [3, 10**6]], {}, "prompt", "prompt 1"),
             (["a", ""], {}, "prompt", "prompt 1 must not be empty"),
             ([[1, 2], too_long], {}, "prompt", "maximum context length"),
             (["a"] * 20, {"n": 128}, "n", "at most 2048 choices")]  # fmt: skip
    for prompt, extra, param, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=4,
                                      **extra)  # fmt: skip
        body: dict = e.value.body  # type: ignore[assignment]
        assert body["param"] == param and says in body["message"], body
    assert _settled_prompt_tokens(cluster) == before
    assert not any(int(v) for v in r.hgetall("conveyor:load:generate").values() if v.isdigit())


# ------------------------------------------------------------------ a worker's cap
@pytest.fixture(scope="module")
def capped(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One worker that holds at most CAP requests (running and queued)."""
    url = redis_dbs.take(__name__)
    logdir = tmp_path_factory.mktemp("capped")
    env = base_env(url, tiny_model_dir, CONVEYOR_WORKER_MAX_REQUESTS=str(CAP),
                   CONVEYOR_ADMISSION_WAIT_S="30")  # fmt: skip
    with one_worker("capped", "capped", env, tiny_model_dir, logdir) as c:
        yield c


def _held(cluster: Cluster) -> int:
    return int(redis.Redis.from_url(cluster.redis_url).hget("conveyor:load:generate",
                                                            "capped:reqs") or 0)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_larger_than_the_worker_cap_runs_to_its_end(capped: Cluster,
                                                            stream: bool) -> None:  # fmt: skip
    """12 prompts of n=2 (24 sequences) on a worker that holds 3 requests: each prompt waits
    for admission until earlier ones end and give their slots back; all 24 choices come,
    each its prompt's output, and every slot is given back."""
    client = capped.client(max_retries=0, timeout=120)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(12)]
    kw: dict[str, Any] = dict(model=capped.model_name, max_tokens=6, temperature=0, n=2,
                              extra_body={"ignore_eos": True})  # fmt: skip
    if stream:
        texts, reasons, _ = _by_index(
            list(client.completions.create(prompt=prompts, stream=True, **kw))
        )
        got = [texts[i] for i in range(24)]
        assert reasons == dict.fromkeys(range(24), "length")
    else:
        got = [c.text for c in client.completions.create(prompt=prompts, **kw).choices]
    want = [t for p in prompts[:3] for t in [_alone(client, capped.model_name, p, max_tokens=6,
                                                    temperature=0,
                                                    extra_body={"ignore_eos": True}
                                                    ).choices[0].text] * 2]  # fmt: skip
    assert got[:6] == want and len(got) == 24 and all(got)
    wait_for(lambda: _held(capped) == 0, 10, "every slot given back")


def test_a_client_gone_mid_stream_frees_every_prompt(capped: Cluster) -> None:
    """A long batch streamed, its client gone after a few chunks: every prompt's requests
    are cancelled and their slots given back (those still waiting never start)."""
    client = capped.client(max_retries=0, timeout=120)
    stream = client.completions.create(model=capped.model_name, prompt=PROMPTS * 3,
                                       max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 5:
            assert _held(capped) == CAP  # the cap's worth started; the rest wait
            break
    stream.close()
    wait_for(lambda: _held(capped) == 0, 10, "every slot given back")
    wait_for(lambda: all(w["running"] == w["waiting"] == 0
                         for w in capped.worker_loads().values()), 10,
             "the worker idle")  # fmt: skip


def test_truncate_prompt_tokens_keeps_the_last_tokens(cluster: Cluster) -> None:
    """vLLM's truncate_prompt_tokens on generation: the prompt's last k tokens only, as
    if only those were sent (completions, each prompt of a batch, and chat's rendered
    prompt); echo repeats what was kept; k beyond the context window is a 400."""
    client = cluster.client(max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cut = dict(kw, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 8})
    for prompt in IDS[1:]:
        got = _alone(client, cluster.model_name, prompt, **cut)
        want = _alone(client, cluster.model_name, prompt[-8:], **kw)
        assert got.usage.prompt_tokens == 8 and got.choices[0].text == want.choices[0].text
    batch = client.completions.create(model=cluster.model_name, prompt=IDS, echo=True, **cut)
    echoed = _alone(client, cluster.model_name, IDS[2][-8:], echo=True, **kw).choices[0].text
    assert batch.choices[2].text == echoed
    assert batch.usage.prompt_tokens == len(IDS[0]) + 8 + 8  # the first is shorter than 8
    msgs = [{"role": "user", "content": "Tell me about the ships on the sea"}]
    body = {"model": cluster.model_name, "messages": msgs}
    ids = httpx.post(f"{cluster.url}/tokenize", json=body).json()["tokens"]
    chat = client.chat.completions.create(model=cluster.model_name, messages=msgs,  # type: ignore[arg-type]
                                          max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 7})  # fmt: skip
    assert chat.usage.prompt_tokens == 7
    last7 = _alone(client, cluster.model_name, ids[-7:], max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == last7.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        _alone(client, cluster.model_name, "x", extra_body={"truncate_prompt_tokens": 10**6})
    assert e.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_a_chat_batch_equals_its_conversations_sent_alone(cluster: Cluster) -> None:
    """vLLM's /v1/chat/completions/batch: one choice per conversation, in order, each the
    greedy answer of that conversation sent alone, with logprobs; usage sums them."""
    convs = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "And a number?"}],
             [{"role": "user", "content": "Hi"}]]  # fmt: skip
    shared = {"model": cluster.model_name, "max_tokens": 7, "temperature": 0,
              "logprobs": True, "top_logprobs": 1}  # fmt: skip
    r = httpx.post(f"{cluster.url}/v1/chat/completions/batch",
                   json={**shared, "messages": convs}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    c = cluster.client(max_retries=0)
    prompt_tokens = 0
    for conv, got in zip(convs, body["choices"], strict=True):
        alone = c.chat.completions.create(messages=conv, **shared)  # type: ignore[call-overload]
        assert got["message"]["content"] == alone.choices[0].message.content
        assert got["finish_reason"] == alone.choices[0].finish_reason
        want = [e.logprob for e in alone.choices[0].logprobs.content]
        assert [e["logprob"] for e in got["logprobs"]["content"]] == pytest.approx(want)
        prompt_tokens += alone.usage.prompt_tokens
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 21

    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"messages": [convs[0], []]}, "messages.1")):  # fmt: skip
        r = httpx.post(f"{cluster.url}/v1/chat/completions/batch",
                       json={**shared, "messages": convs, **extra}, timeout=60)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
