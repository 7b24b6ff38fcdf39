"""Structured outputs through the real pipeline (redis-server, `conveyor worker` processes
on the reference engine, the API over HTTP, the official openai client), on the tiny
random-weight model:

* every schema of the corpus (tests/data/json_schemas.json) gives JSON that validates with
  ``jsonschema``, streamed and not, aggregated and prefill -> decode (the prompts are long
  enough to go through both workers; the decode worker's pull counter shows they did), and
  the greedy output is the same text in every one of those runs;
* json_object, regex, choice, grammar and structural_tag, each in both modes;
* a schema that does not compile is a 400 naming the problem and the field (the API's own
  metaschema check, and the engine's compile error, streamed or not, in both modes);
* a constrained stream whose worker is killed mid-way finishes on the other worker, as
  the uninterrupted run, and validates.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import redis

from cluster.keys import worker_key
from tests.integration.conftest import (
    Cluster,
    Proc,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
CONCURRENCY = 16
SYSTEM = ("You answer with one JSON document that follows the schema you are given, and "
          "nothing else. Keys in the order of the schema.")  # fmt: skip


def _messages(name: str) -> list[dict]:
    """About a hundred tokens: several KV blocks for prefill to hand to decode."""
    ask = f"Write the {name.replace('_', ' ')} document."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


def _rf(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@dataclass
class PD:
    url: str
    redis_url: str
    procs: list[Proc]
    model: str

    def pulls(self) -> int:
        raw = redis.Redis.from_url(self.redis_url).get(worker_key("decode", "so-d"))
        return json.loads(raw)["kv_transfer"]["count"] if raw else 0


@pytest.fixture(scope="module")
def pd(redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[PD]:  # fmt: skip
    url = redis_dbs.take(__name__)
    # every request through both workers: with the default threshold, a prompt the decode
    # worker finds mostly cached (the same system message, a second run) prefills there
    env = base_env(url, tiny_model_dir, CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    logdir = tmp_path_factory.mktemp("so-pd")
    pre = start_worker("so-prefill", "prefill", "so-p", env, logdir)
    dec = start_worker("so-decode", "decode", "so-d", env, logdir)
    with stop_on_error(pre, dec):
        api, api_url = start_api("so-api", env, logdir)
    d = PD(api_url, url, [api, pre, dec], tiny_model_dir.name)
    with stop_on_error(*d.procs):
        both = {"prefill": 1, "decode": 1}
        wait_for(lambda: httpx.get(f"{api_url}/health").json()["workers"] == both, 90,
                 "prefill and decode workers", d.procs)  # fmt: skip
    yield d
    for p in d.procs:
        p.stop()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)


async def _chat(client: openai.AsyncOpenAI, model: str, stream: bool,
                on_chunk: Callable[[], None] | None = None, **kw: object
                ) -> tuple[str, str, int]:  # fmt: skip
    """(text, finish_reason, completion tokens) of one chat completion (a completion when
    ``kw`` has a prompt); ``on_chunk`` is called at every streamed chunk with a choice."""
    api = client.completions if "prompt" in kw else client.chat.completions
    if not stream:
        r = await api.create(model=model, **kw)  # type: ignore[call-overload]
        c = r.choices[0]
        text = c.text if "prompt" in kw else c.message.content
        return text or "", c.finish_reason, r.usage.completion_tokens
    s = await api.create(  # type: ignore[call-overload]
        model=model, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, reason, usage = [], "", 0
    async for chunk in s:
        if chunk.choices:
            c = chunk.choices[0]
            text.append((c.text if "prompt" in kw else c.delta.content) or "")
            reason = c.finish_reason or reason
            if on_chunk is not None:
                on_chunk()
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return "".join(text), reason, usage


def _corpus_run(url: str, model: str, stream: bool) -> dict[str, str]:
    """Every schema of the corpus at once (16 in flight), greedy: name -> text."""

    async def run() -> dict[str, str]:
        client, sem = _client(url), asyncio.Semaphore(CONCURRENCY)

        async def one(c: dict) -> tuple[str, str]:
            async with sem:
                text, reason, _ = await _chat(
                    client, model, stream, messages=_messages(c["name"]), temperature=0,
                    max_tokens=600, response_format=_rf(c["name"], c["schema"]),
                )  # fmt: skip
            assert reason == "stop", (c["name"], reason, text)
            return c["name"], text

        try:
            return dict(await asyncio.gather(*(one(c) for c in CORPUS)))
        finally:
            await client.close()

    got = asyncio.run(run())
    for c in CORPUS:
        jsonschema.validate(json.loads(got[c["name"]]), c["schema"])
    return got


@pytest.fixture(scope="module")
def agg_corpus(cluster: Cluster) -> dict[str, str]:
    return _corpus_run(cluster.url, cluster.model_name, stream=False)


# ----------------------------------------------------------------------------------------


def test_the_corpus_validates_aggregated(agg_corpus: dict[str, str], cluster: Cluster) -> None:
    assert len(agg_corpus) == len(CORPUS) >= 50
    streamed = _corpus_run(cluster.url, cluster.model_name, stream=True)
    assert streamed == agg_corpus


@pytest.mark.parametrize("stream", [False, True])
def test_the_corpus_validates_prefill_decode_as_aggregated(
    pd: PD, agg_corpus: dict[str, str], stream: bool
) -> None:
    before = pd.pulls()
    got = _corpus_run(pd.url, pd.model, stream)
    assert got == agg_corpus  # the same greedy text as one worker doing both
    # each went prefill worker -> KV pull -> decode worker (heartbeats lag a little)
    wait_for(lambda: pd.pulls() - before >= len(CORPUS), 10, "a KV pull per request", pd.procs)


# (the request's fields, what its text must satisfy). json_object is any JSON object, not a
# bounded one: on random weights a string in it can run to max_tokens. These prompts (as a
# completion) give ones that end; under the chat prompt below, greedy decoding never closes
# its first key.
KINDS = [
    ({"prompt": "Answer number 1:",  # (openai's completions take it in extra_body)
      "extra_body": {"response_format": {"type": "json_object"}}},
     lambda t: isinstance(json.loads(t), dict)),
    ({"extra_body": {"guided_regex": r"[A-Z][a-z]{1,5} [0-9]{2}"}},
     lambda t: re.fullmatch(r"[A-Z][a-z]{1,5} [0-9]{2}", t)),
    ({"extra_body": {"structured_outputs": {"choice": ["red", "green", "blue \"sky\""]}}},
     lambda t: t in ("red", "green", 'blue "sky"')),
    ({"extra_body": {"guided_grammar": 'root ::= "[" n ("," n){0,2} "]"\nn ::= [1-9] [0-9]?'}},
     lambda t: re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?){0,2}\]", t)),
    ({"response_format": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<tool>", "end": "</tool>",
        "content": {"type": "json_schema", "max_whitespace_cnt": 1, "json_schema": {
            "type": "object", "required": ["city"],
            "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}}},
     lambda t: re.fullmatch(r'<tool>\{\s?"city"\s?:\s?"(Paris|Oslo)"\s?\}</tool>', t)),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["agg", "pd"])
def test_each_kind_of_constraint_end_to_end(mode: str, request: pytest.FixtureRequest) -> None:
    """json_object, regex, choice, grammar and structural tag; greedy and seeded sampling,
    streamed and not."""
    c = request.getfixturevalue("cluster" if mode == "agg" else "pd")
    url, model = c.url, getattr(c, "model_name", getattr(c, "model", ""))

    async def run() -> list[tuple[int, str, str]]:
        client = _client(url)
        jobs = []
        for k, (kw, _) in enumerate(KINDS):
            for i, (stream, temp) in enumerate([(False, 0.0), (True, 0.0), (True, 1.0)]):
                words = {} if "prompt" in kw else {"messages": _messages(f"kind {k}")}
                jobs.append((k, _chat(client, model, stream, temperature=temp, seed=i,
                                      max_tokens=300, **words, **kw)))  # fmt: skip
        try:
            done = await asyncio.gather(*(j for _, j in jobs))
        finally:
            await client.close()
        return [(k, text, reason) for (k, _), (text, reason, _) in zip(jobs, done, strict=True)]

    for k, text, reason in asyncio.run(run()):
        assert reason == "stop" and KINDS[k][1](text), (k, reason, text)


@pytest.mark.parametrize("mode", ["agg", "pd"])
def test_a_schema_that_does_not_compile_is_a_400_naming_it(
    mode: str, request: pytest.FixtureRequest
) -> None:
    c = request.getfixturevalue("cluster" if mode == "agg" else "pd")
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="x", max_retries=0)
    model = getattr(c, "model_name", getattr(c, "model", ""))
    messages = _messages("broken")
    missing_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=messages, stream=stream,
                                           response_format=_rf("x", missing_ref))  # type: ignore[call-overload]  # fmt: skip
        err = e.value.body
        assert err["code"] == "invalid_structured_output", err
        assert err["param"] == "response_format.json_schema"
        assert "Cannot find field $defs" in err["message"], err
    # an invalid regex, through vLLM's older field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x" * 60,
                                  extra_body={"guided_regex": "[a-"})  # fmt: skip
    assert e.value.body["param"] == "guided_regex" and "could not be compiled" in e.value.body[
        "message"]  # fmt: skip
    # what the metaschema rules out never reaches a worker
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages,
                                       response_format=_rf("x", {"type": "strnig"}))  # type: ignore[call-overload]  # fmt: skip
    assert e.value.body["param"] == "response_format.json_schema"
    assert "not a valid JSON Schema" in e.value.body["message"], e.value.body


MIGRATION_SCHEMA = {"type": "array", "minItems": 12, "maxItems": 12, "items": {
    "type": "object", "required": ["id", "name", "ok"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "minLength": 3, "maxLength": 6},
        "ok": {"type": "boolean"}}}}  # fmt: skip


def test_a_migrated_constrained_stream_finishes_as_uninterrupted_and_validates(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Eight constrained streams on two workers; one worker is SIGKILLed mid-stream: the
    streams it held move to the other one, whose matcher replays what they had, and every
    stream ends with the uninterrupted run's text, which validates."""
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir)
    workers = [start_worker(f"so-mig{i}", "generate", f"so-mig{i}", env, tmp_path)
               for i in range(2)]  # fmt: skip
    procs: list[Proc] = list(workers)
    model = tiny_model_dir.name
    rf = _rf("rows", MIGRATION_SCHEMA)
    try:
        with stop_on_error(*workers):
            api, url = start_api("so-mig-api", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"]["generate"] == 2, 90,
                 "two workers", procs)  # fmt: skip
        # each stream pinned, half to the worker that dies: KV-aware routing alone may put
        # all eight on the worker that holds the shared prefix, and then nothing moves
        sampling: list[dict[str, object]] = [
            {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": 50 + i}
            for i in range(8)]  # fmt: skip
        for i, kw in enumerate(sampling):
            kw["extra_body"] = {"worker_id": f"so-mig{i // 4}"}

        async def uninterrupted() -> list[tuple[str, str, int]]:
            client = _client(url)
            try:
                return await asyncio.gather(*(
                    _chat(client, model, False, messages=_messages(f"rows {i}"),
                          response_format=rf, max_tokens=800, **sampling[i])
                    for i in range(8)))  # fmt: skip
            finally:
                await client.close()

        want = asyncio.run(uninterrupted())
        progress = [0] * 8

        def stream(client: openai.AsyncOpenAI, i: int) -> Coroutine[Any, Any, tuple[str, str, int]]:
            def count() -> None:
                progress[i] += 1

            return _chat(client, model, True, count, messages=_messages(f"rows {i}"),
                         response_format=rf, max_tokens=800, **sampling[i])  # fmt: skip

        async def run() -> list[tuple[str, str, int]]:
            client = _client(url)
            try:
                tasks = [asyncio.create_task(stream(client, i)) for i in range(8)]
                deadline = time.monotonic() + 60
                while min(progress) < 5:  # every stream under way, none near its end
                    assert time.monotonic() < deadline, progress
                    await asyncio.sleep(0.01)
                os.kill(workers[0].popen.pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)
            finally:
                await client.close()

        got = asyncio.run(run())
        workers[0].popen.wait(30)
        for i, ((text, reason, usage), (want_text, _, want_usage)) in enumerate(
            zip(got, want, strict=True)
        ):
            assert (text, reason, usage) == (want_text, "stop", want_usage), i
            jsonschema.validate(json.loads(text), MIGRATION_SCHEMA)
        moved = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                 if line.startswith('conveyor_migrations_total{outcome="moved"')]  # fmt: skip
        assert moved and float(moved[0].split()[-1]) == 4, moved  # all pinned to the dead one
    finally:
        for p in procs:
            p.stop()
        r.flushdb()
