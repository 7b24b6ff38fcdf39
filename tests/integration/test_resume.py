"""Resumable streams (``CONVEYOR_RESUMABLE_STREAMS``), with real processes: two API
replicas, one mock worker, the official openai client.

* **Killed API**: a chat stream, and a completion stream, read from the first API process
  until a few events are in; that process is SIGKILLed; the client sends the same request
  to the second API with ``Last-Event-ID`` and gets the rest. The whole text equals an
  uninterrupted greedy run, nothing lost or repeated, and the usage is exact.
* **Grace**: a client that drops its connection and comes back within
  ``CONVEYOR_RESUME_GRACE_S`` gets the rest; one that does not is cancelled afterwards.
* Bad or expired ids are 400 / 404 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from api.resume import FrameLogReader, moved_commands, resumed_batches
from kvbm.protocol import TokenFrame, frames_key
from tests.integration.conftest import (
    Proc,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

MAX_TOKENS = 40


@pytest.fixture
def deployment(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[Proc, str, Proc, str, Proc]]:
    # ~25 ms a token: a stream runs about a second, long enough to kill its API mid-way
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__DECODE_STEP_MS="25", CONVEYOR_MOCK__SPEEDUP="1",
                   CONVEYOR_RESUMABLE_STREAMS="true", CONVEYOR_RESUME_GRACE_S="2")  # fmt: skip
    worker = start_worker("resume-worker", "generate", "resume-w", env, tmp_path)
    with stop_on_error(worker):
        api1, url1 = start_api("resume-api1", env, tmp_path)
    with stop_on_error(worker, api1):
        api2, url2 = start_api("resume-api2", env, tmp_path)
    with stop_on_error(worker, api1, api2):
        for u in (url1, url2):
            wait_for(lambda u=u: httpx.get(f"{u}/health").status_code == 200, 60,
                     "a live worker", [worker, api1, api2])  # fmt: skip
    yield api1, url1, api2, url2, worker
    for p in (api1, api2, worker):
        p.stop()


def _body(kind: str, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me about rivers."}]
    else:
        body["prompt"] = "Rivers are"
    return body


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _text(chunk: dict) -> str:
    c = (chunk.get("choices") or [{}])[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


def _read_some(url: str, body: dict, path: str, events: int) -> tuple[str, list[dict]]:
    """Open a stream and read ``events`` events with text; the last event id and the
    chunks read (the connection is left open: the caller kills or drops it)."""
    client = httpx.Client(timeout=30)
    r = client.send(client.build_request("POST", url + path, json=body), stream=True)
    assert r.status_code == 200, r.read()
    last_id, chunks, lines = "", [], r.iter_lines()
    for line in lines:
        if line.startswith("id: "):
            last_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
            if sum(1 for c in chunks if _text(c)) >= events:
                break
    # the write that held the last chunk carried the id after it: read to the blank line
    for line in lines:
        if line.startswith("id: "):
            last_id = line[4:]
        if not line:
            break
    assert last_id, "no SSE id: the stream is not resumable"
    return last_id, chunks


def _reference(url: str, kind: str, model: str) -> tuple[str, int]:
    """An uninterrupted greedy run of the same request: its text and completion tokens."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    body = _body(kind, model)
    body.pop("stream"), body.pop("stream_options")
    body["extra_body"] = {"ignore_eos": body.pop("ignore_eos")}
    if kind == "chat":
        out = c.chat.completions.create(**body)
        return out.choices[0].message.content or "", out.usage.completion_tokens
    out2 = c.completions.create(**body)
    return out2.choices[0].text, out2.usage.completion_tokens


def _resume(url: str, kind: str, model: str, last_id: str,
            max_tokens: int = MAX_TOKENS) -> tuple[str, int]:  # fmt: skip
    """The official client, sending the same request again with Last-Event-ID."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    body = {**_body(kind, model), "max_tokens": max_tokens}
    body["extra_body"] = {"ignore_eos": body.pop("ignore_eos")}
    create = c.chat.completions.create if kind == "chat" else c.completions.create
    text, usage = [], None
    for chunk in create(**body, extra_headers={"Last-Event-ID": last_id}):  # type: ignore[operator]
        if chunk.choices:
            choice = chunk.choices[0]
            text.append(choice.delta.content or "" if kind == "chat" else choice.text)
        usage = chunk.usage or usage
    assert usage is not None
    return "".join(text), usage.completion_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_goes_on_through_another_api_after_its_api_is_killed(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path, kind: str
) -> None:
    api1, url1, _, url2, _ = deployment
    model = tiny_model_dir.name
    want_text, want_tokens = _reference(url2, kind, model)
    last_id, chunks = _read_some(url1, _body(kind, model), _path(kind), 5)
    api1.popen.send_signal(signal.SIGKILL)
    api1.popen.wait(10)
    rest, tokens = _resume(url2, kind, model, last_id)
    got = "".join(_text(c) for c in chunks) + rest
    assert got == want_text, (got, want_text)
    assert tokens == want_tokens == MAX_TOKENS
    assert rest and len(rest) < len(want_text)  # the resume sent the rest, not everything


def test_a_client_back_within_the_grace_period_gets_the_rest_one_not_back_is_cancelled(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path, fresh_db: str
) -> None:
    _, url1, _, url2, worker = deployment
    model = tiny_model_dir.name
    # drop the connection, come back (to the other replica) within the 2 s of grace: the
    # stream (160 tokens, ~4 s) runs on past the grace period to its end
    long = {**_body("chat", model), "max_tokens": 160}
    last_id, chunks = _read_some(url1, long, _path("chat"), 3)
    rest, tokens = _resume(url2, "chat", model, last_id, max_tokens=160)
    assert tokens == 160 and "".join(_text(c) for c in chunks) + rest
    # drop it and never come back: cancelled once the grace period is over, well before
    # the ~1 s more its tokens would take... measured on the worker's finish line
    long_body = {**_body("chat", model), "max_tokens": 400}
    last_id, _ = _read_some(url1, long_body, _path("chat"), 2)
    rid = last_id.rsplit(":", 1)[0]
    t0 = time.monotonic()
    wait_for(lambda: f"[{rid}] abort:" in worker.log.read_text(), 15, "the cancel")
    assert 1.5 <= time.monotonic() - t0 <= 8
    # its log stays readable until it expires
    assert redis.Redis.from_url(fresh_db).exists(frames_key(rid))


def test_bad_and_unknown_event_ids(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    _, _, _, url2, _ = deployment
    body = _body("chat", tiny_model_dir.name)
    cases = [
        ("nonsense", 400, "invalid_event_id"),
        ("cmpl-abc:3", 400, "invalid_event_id"),  # another endpoint's
        ("chatcmpl-0123456789abcdef:7", 404, "stream_not_found"),
    ]
    for value, status, code in cases:
        r = httpx.post(f"{url2}/v1/chat/completions", json=body,
                       headers={"Last-Event-ID": value})  # fmt: skip
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["param"] == "Last-Event-ID"


def test_the_log_reader_follows_a_migration_and_drops_a_lost_attempt_s_frames(
    fresh_db: str,
) -> None:
    """A stream moved to another worker: the old log ends with the pointer (and the dead
    worker's late frames after it); the reader gives seq 0.. once, across both logs, and
    splits the first batch at what the client has."""
    r = redis.Redis.from_url(fresh_db)

    def frame(seq: int, text: str, done: bool = False) -> bytes:
        return TokenFrame(seq, [seq], text, done, "length" if done else None).encode()

    for seq in range(3):
        r.xadd(frames_key("chatcmpl-a"), {"f": frame(seq, f"t{seq}")})
    for command in moved_commands("chatcmpl-a", "chatcmpl-a.m1", 3):
        r.execute_command(*command)
    r.xadd(frames_key("chatcmpl-a"), {"f": frame(3, "LATE")})  # the lost attempt's
    r.xadd(frames_key("chatcmpl-a.m1"), {"f": frame(3, "t3")})
    r.xadd(frames_key("chatcmpl-a.m1"), {"f": frame(4, "t4", done=True)})

    async def read(after: int) -> list[list[tuple[int, str]]]:
        client = aioredis.Redis.from_url(fresh_db)
        reader = FrameLogReader(client, "chatcmpl-a", timeout_s=5)
        out = [[(f.seq, f.text) for f in batch] async for batch in resumed_batches(reader, after)]
        await client.aclose()
        return out

    assert asyncio.run(read(1)) == [[(0, "t0"), (1, "t1")], [(2, "t2")], [(3, "t3"), (4, "t4")]]
    flat = [f for batch in asyncio.run(read(-1)) for f in batch]
    assert flat == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3"), (4, "t4")]


# --------------------------------------------------------------------------------------
# Background responses
# --------------------------------------------------------------------------------------
def _responses(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _ask(max_output_tokens: int = MAX_TOKENS) -> dict:
    return {"input": "Tell me about rivers.", "max_output_tokens": max_output_tokens,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip


def _until_done(client: openai.OpenAI, rid: str, timeout: float = 30) -> object:
    t0 = time.monotonic()
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() - t0 < timeout, f"{rid} still {r.status}"
        time.sleep(0.1)


def test_a_background_response_survives_its_api_and_is_read_on_another(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    api1, url1, _, url2, _ = deployment
    model = tiny_model_dir.name
    want = _responses(url2).responses.create(model=model, **_ask())  # type: ignore[arg-type]
    assert want.status == "incomplete" and want.output_text  # it hit max_output_tokens
    bg = _responses(url1).responses.create(model=model, background=True, **_ask())  # type: ignore[arg-type]
    assert bg.status == "in_progress" and bg.background
    api1.popen.send_signal(signal.SIGKILL)  # the API that accepted it dies at once
    api1.popen.wait(10)
    done = _until_done(_responses(url2), bg.id)
    assert done.status == "incomplete" and done.output_text == want.output_text  # type: ignore[attr-defined]
    assert done.usage.output_tokens == MAX_TOKENS  # type: ignore[attr-defined]
    again = _responses(url2).responses.retrieve(bg.id)  # stored now: the same answer
    assert again.output_text == want.output_text and again.id == bg.id


def test_a_background_stream_is_read_again_after_an_event_number(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    _, url1, _, url2, _ = deployment
    model = tiny_model_dir.name
    first, events = [], _responses(url2).responses.create(
        model=model, background=True, stream=True, **_ask())  # type: ignore[arg-type]  # fmt: skip
    for ev in events:  # a few events, then the client goes away
        first.append(ev)
        if len(first) >= 8:
            break
    events.close()
    rid = first[0].response.id  # type: ignore[union-attr]
    n = first[-1].sequence_number
    rest = list(_responses(url1).responses.retrieve(rid, stream=True, starting_after=n))
    seqs = [e.sequence_number for e in first + rest]
    assert seqs == list(range(len(seqs))), seqs  # nothing lost or repeated, across APIs
    assert rest[-1].type == "response.completed"
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == rest[-1].response.output_text  # type: ignore[union-attr]
    assert _responses(url1).responses.retrieve(rid).output_text == text


def test_a_background_response_is_cancelled_from_any_api(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    _, url1, _, url2, _ = deployment
    bg = _responses(url1).responses.create(model=tiny_model_dir.name, background=True,
                                           **_ask(400))  # type: ignore[arg-type]  # fmt: skip
    assert _responses(url2).responses.cancel(bg.id).status == "cancelled"
    done = _until_done(_responses(url2), bg.id)
    assert done.status == "cancelled"
    assert 0 < done.usage.output_tokens < 400  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        _responses(url2).responses.retrieve("resp_00000000000000000000000000000000")


# --------------------------------------------------------------------------------------
# n > 1 choices, and the Responses API's foreground streams
# --------------------------------------------------------------------------------------
def _by_choice(chunks: list[dict], n: int) -> list[str]:
    """Each choice's text from a stream's chunks."""
    out = [""] * n
    for c in chunks:
        for choice in c.get("choices") or []:
            out[choice["index"]] += (choice.get("delta") or {}).get("content") or ""
    return out


def test_a_stream_of_two_choices_goes_on_through_another_api_within_the_grace_period(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    """The client drops a stream of n=2 from the first API and sends the same request to
    the second with its last id: both choices go on from where each was, and the first
    API keeps the request running through the gap (the grace period)."""
    _, url1, _, url2, _ = deployment
    body = {**_body("chat", tiny_model_dir.name), "n": 2}
    c = openai.OpenAI(base_url=f"{url2}/v1", api_key="x", max_retries=0)
    whole = c.chat.completions.create(  # type: ignore[call-overload]
        **{k: v for k, v in body.items() if k not in ("stream", "stream_options", "ignore_eos")},
        extra_body={"ignore_eos": True})  # fmt: skip
    want = [ch.message.content for ch in sorted(whole.choices, key=lambda ch: ch.index)]
    last_id, chunks = _read_some(url1, body, _path("chat"), 6)
    assert "," in last_id.rsplit(":", 1)[1]  # a seq per choice
    got, usage = _by_choice(chunks, 2), None
    resumed = c.chat.completions.create(  # type: ignore[call-overload]
        **{k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True},
        extra_headers={"Last-Event-ID": last_id})  # fmt: skip
    rest = ["", ""]
    for chunk in resumed:
        for choice in chunk.choices:
            rest[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert [a + b for a, b in zip(got, rest, strict=True)] == want
    assert any(rest) and sum(map(len, rest)) < sum(map(len, want))  # the rest, not all
    assert usage is not None and usage.completion_tokens == 2 * MAX_TOKENS
    # an id with one seq does not name a stream of two choices
    r = httpx.post(f"{url2}/v1/chat/completions", json=body,
                   headers={"Last-Event-ID": last_id.rsplit(",", 1)[0]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_event_id"


def _read_response_events(url: str, body: dict, events: int) -> tuple[str, list[dict]]:
    """Open a Responses stream and read ``events`` events; the last SSE id and the events
    (the connection is left open)."""
    client = httpx.Client(timeout=30)
    r = client.send(client.build_request("POST", url + "/v1/responses", json=body), stream=True)
    assert r.status_code == 200, r.read()
    last_id, got = "", []
    for line in r.iter_lines():
        if line.startswith("id: "):
            last_id = line[4:]
        elif line.startswith("data: "):
            got.append(json.loads(line[6:]))
            if len(got) >= events:
                break
    assert last_id.endswith(f":{got[-1]['sequence_number']}"), (last_id, got[-1])
    return last_id, got


@pytest.mark.parametrize("how", ["killed", "dropped"])
def test_a_response_stream_goes_on_through_another_api_after_its_api_is_killed(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path, how: str
) -> None:
    """The first API is killed, or the client drops the connection (the first API keeps
    the response running for the grace period): the rest comes from the second API."""
    api1, url1, _, url2, _ = deployment
    model = tiny_model_dir.name
    want = _responses(url2).responses.create(model=model, **_ask())  # type: ignore[arg-type]
    body = {"model": model, "input": "Tell me about rivers.", "max_output_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    last_id, first = _read_response_events(url1, body, 8)  # its connection closes on return
    if how == "killed":
        api1.popen.send_signal(signal.SIGKILL)
        api1.popen.wait(10)
    rest = list(
        _responses(url2).responses.create(  # type: ignore[call-overload]
            model=model, stream=True, extra_headers={"Last-Event-ID": last_id}, **_ask()
        )
    )
    seqs = [e["sequence_number"] for e in first] + [e.sequence_number for e in rest]
    assert seqs == list(range(len(seqs))), seqs  # nothing lost or repeated, across APIs
    assert rest and rest[-1].type == "response.completed"
    final = rest[-1].response
    text = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta")
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == final.output_text == want.output_text
    assert final.id == first[0]["response"]["id"] and final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == MAX_TOKENS
    # the response can be read back while its record is kept; it is not a background one
    again = _responses(url2).responses.retrieve(final.id)
    assert again.output_text == want.output_text and not again.background
    with pytest.raises(openai.BadRequestError):
        _responses(url2).responses.cancel(final.id)
    # its stream read again by GET, after the event the Last-Event-ID header names
    got = httpx.get(f"{url2}/v1/responses/{final.id}", params={"stream": "true"},
                    headers={"Last-Event-ID": last_id}, timeout=30)  # fmt: skip
    again_seqs = [json.loads(line[6:])["sequence_number"]
                  for line in got.text.splitlines() if line.startswith("data: ")]  # fmt: skip
    assert again_seqs == seqs[len(first) :]
    # an unknown response's id: 404, in the error's shape
    r = httpx.post(f"{url2}/v1/responses", json=body,
                   headers={"Last-Event-ID": "resp_0123456789abcdef:3"})  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"


def test_an_echo_alone_resumes_without_its_dropped_token(
    deployment: tuple[Proc, str, Proc, str, Proc], tiny_model_dir: Path
) -> None:
    """echo with max_tokens 0 runs one token the API drops: read again from its frame log
    (a client resuming before its first frame, on another API), the stream drops it too:
    the echo alone, 0 completion tokens."""
    _, url1, _, url2, _ = deployment
    body = {**_body("completion", tiny_model_dir.name), "max_tokens": 0, "echo": True}
    with httpx.stream("POST", f"{url1}/v1/completions", json=body, timeout=30) as r:
        lines = list(r.iter_lines())
    ids = [ln[4:] for ln in lines if ln.startswith("id: ")]
    assert ids, lines
    log_id = ids[-1].rpartition(":")[0]
    c = openai.OpenAI(base_url=f"{url2}/v1", api_key="x", max_retries=0)
    sent = {k: v for k, v in body.items() if k not in ("ignore_eos", "model", "prompt")}
    again = list(c.completions.create(model=tiny_model_dir.name, prompt="Rivers are",
                                      extra_headers={"Last-Event-ID": f"{log_id}:-1"},
                                      extra_body={"ignore_eos": True}, **sent))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in again if ch.choices) == "Rivers are"
    assert [ch.choices[0].finish_reason for ch in again if ch.choices][-1] == "length"
    assert again[-1].usage is not None and again[-1].usage.completion_tokens == 0
