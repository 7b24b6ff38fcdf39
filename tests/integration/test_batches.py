"""The Files and Batch APIs with real processes (a mock worker, the API, ``conveyor
batch-runner``) and the official openai client: a batch's output holds every request's
answer once, in OpenAI's format, a bad request's error in the error file; a batch runner
stopped mid-batch hands the batch on and the next one finishes it with no request lost or
repeated, as does one killed (SIGKILL) once its lease lapses, with no two runners sending
the same requests (one frozen past its lease stops sending once thawed); a cancel stops a
batch with what was answered so far. Anthropic's Message Batches run on the same runner."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis

from tasks.app import queue
from tasks.batches import BATCH_QUEUE, lease_key, results_key, run_batch, runners_key
from tests.integration.conftest import (
    BIN,
    Proc,
    base_env,
    celery_at,
    free_port,
    spawn,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


LEASE_S, RECOVER_S, IN_FLIGHT = 6.0, 1.0, 2  # a killed runner's batch waits out its lease


@pytest.fixture
def env(fresh_db: str, tiny_model_dir: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> dict[str, str]:  # fmt: skip
    # the mock engine (unless a test names another: indirect parametrization) at ~10 ms a
    # token: a request of 8 tokens takes ~0.1 s
    engine = getattr(request, "param", "mock")
    return base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE=engine,
                    CONVEYOR_MOCK__DECODE_STEP_MS="10", CONVEYOR_MOCK__SPEEDUP="1",
                    CONVEYOR_FILES_DIR=str(tmp_path / "files"),
                    CONVEYOR_BATCH_MAX_IN_FLIGHT=str(IN_FLIGHT),
                    CONVEYOR_BATCH_LEASE_S=str(LEASE_S),
                    CONVEYOR_BATCH_RECOVER_S=str(RECOVER_S))  # fmt: skip


@pytest.fixture
def deployment(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, Proc]]:
    worker = start_worker("batch-worker", "generate", "batch-w", env, tmp_path)
    with stop_on_error(worker):
        api, url = start_api("batch-api", env, tmp_path)
    env["CONVEYOR_BATCH_API_URL"] = url
    with stop_on_error(worker, api):
        runner = spawn("batch-runner", [str(BIN / "conveyor"), "batch-runner"], env, tmp_path)
    with stop_on_error(worker, api, runner):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "a live worker",
                 [worker, api, runner])  # fmt: skip
        wait_for(lambda: _runners(env), 60, "a live batch runner", [runner])
    yield url, runner
    for p in (runner, api, worker):
        p.stop()


def _runners(env: dict[str, str]) -> int:
    return int(redis.Redis.from_url(env["CONVEYOR_REDIS_URL"]).zcount(
        runners_key(), int(time.time() * 1000), "+inf"))  # fmt: skip


def _jsonl(model: str, n: int, bad: tuple[int, ...] = ()) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": model, "max_tokens": -1 if i in bad else 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _until(client: openai.OpenAI, batch_id: str, states: tuple[str, ...], timeout: float = 90):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while (b := client.batches.retrieve(batch_id)).status not in states:
        assert time.monotonic() - t0 < timeout, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.2)
    return b


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def test_a_batch_answers_every_request_once(deployment: tuple[str, Proc],
                                            tiny_model_dir: Path) -> None:  # fmt: skip
    url, _ = deployment
    c = _client(url)
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 12, bad=(5,)))),
                       purpose="batch")  # fmt: skip
    assert f.purpose == "batch" and f.bytes > 0
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"run": "one"})  # fmt: skip
    assert b.status == "in_progress" and b.request_counts.total == 12
    done = _until(c, b.id, ("completed",))
    assert done.request_counts.completed == 11 and done.request_counts.failed == 1
    assert done.metadata == {"run": "one"}
    out, err = _lines(c, done.output_file_id), _lines(c, done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(12) if i != 5]
    for x in out:  # OpenAI's output line
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
        assert x["response"]["request_id"] == body["id"]
    (e,) = err
    assert e["custom_id"] == "req-5" and e["response"]["status_code"] == 400
    assert e["error"]["message"]
    assert [x.id for x in c.batches.list().data][0] == b.id
    with pytest.raises(openai.BadRequestError):  # a file whose lines are not requests
        bad = c.files.create(file=("x.jsonl", io.BytesIO(b"nope\n")), purpose="batch")
        c.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_000000000000000000000000")


def test_responses_and_batched_prompts_in_batches(deployment: tuple[str, Proc],
                                                  tiny_model_dir: Path) -> None:  # fmt: skip
    """A batch of Responses requests (a background one answered in full, not with its
    receipt), one of completions whose lines each hold a batch of prompts, and batches of
    vLLM's /v1/score and /v1/rerank."""
    url, _ = deployment

    def run(endpoint: str, bodies: list[dict]) -> list[dict]:
        return _run_batch(url, tiny_model_dir.name, endpoint, bodies)

    got = run(
        "/v1/responses",
        [
            {"input": "hello", "max_output_tokens": 5},
            {"input": "again", "max_output_tokens": 5, "background": True},
        ],
    )
    assert [(r["object"], r["status"]) for r in got] == [("response", "incomplete")] * 2
    assert all(r["usage"]["output_tokens"] == 5 for r in got)
    (whole,) = run("/v1/completions", [{"prompt": ["a", "b", "c"], "max_tokens": 4}])
    assert [ch["index"] for ch in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 12


def _ended(c: anthropic.Anthropic, batch_id: str, timeout: float = 120) -> object:
    deadline = time.monotonic() + timeout
    while (b := c.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    return b


def test_message_batches(deployment: tuple[str, Proc], tiny_model_dir: Path) -> None:
    """Anthropic's Message Batches API on the same runner, with the anthropic client: every
    request answered once, in order, a failed one as Anthropic's error; a bad request
    refuses the whole batch; a cancel leaves the unsent ``canceled``; list and delete."""
    url, _ = deployment
    c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    model = tiny_model_dir.name

    def item(i: int, **kw: object) -> dict:
        params = {"model": model, "max_tokens": 8,
                  "messages": [{"role": "user", "content": f"question {i}"}], **kw}  # fmt: skip
        return {"custom_id": f"q-{i}", "params": params}

    requests = [item(i) for i in range(6)] + [item(6, model="no-such-model")]
    b = c.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert b.id.startswith("msgbatch_") and b.type == "message_batch"
    assert b.processing_status == "in_progress" and b.results_url is None
    assert b.request_counts.processing == 7
    done = _ended(c, b.id)
    assert (done.request_counts.succeeded, done.request_counts.errored) == (6, 1)  # type: ignore[attr-defined]
    assert done.ended_at is not None and done.results_url  # type: ignore[attr-defined]
    results = list(c.messages.batches.results(b.id))
    assert [r.custom_id for r in results] == [f"q-{i}" for i in range(7)]
    for r in results[:6]:
        assert r.result.type == "succeeded"
        msg = r.result.message  # type: ignore[union-attr]
        assert msg.usage.output_tokens == 8 and msg.stop_reason == "max_tokens"
    err = results[6].result
    assert err.type == "errored" and err.error.error.type == "not_found_error"  # type: ignore[union-attr]
    assert [x.id for x in c.messages.batches.list(limit=5)][0] == b.id
    # OpenAI's batches and Anthropic's are listed apart
    assert b.id not in [x.id for x in _client(url).batches.list().data]

    # a request /v1/messages would refuse refuses the batch, naming it: nothing is queued
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.batches.create(requests=[item(0), item(1, max_tokens=0)])  # type: ignore[list-item]
    assert e.value.body["error"]["param"] == "requests.1.params.max_tokens"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):  # custom ids are unique
        c.messages.batches.create(requests=[item(0), item(0)])  # type: ignore[list-item]

    # cancelled at once: what was sent is answered, the rest canceled
    big = c.messages.batches.create(requests=[item(i) for i in range(40)])  # type: ignore[arg-type]
    c.messages.batches.cancel(big.id)
    ended = _ended(c, big.id)
    counts = ended.request_counts  # type: ignore[attr-defined]
    assert counts.canceled > 0 and counts.succeeded + counts.canceled == 40
    kinds = [r.result.type for r in c.messages.batches.results(big.id)]
    assert kinds.count("canceled") == counts.canceled and "errored" not in kinds
    assert ended.cancel_initiated_at is not None  # type: ignore[attr-defined]

    assert c.messages.batches.delete(big.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve(big.id)


def _run_batch(url: str, model: str, endpoint: str, bodies: list[dict]) -> list[dict]:
    """Run a batch of ``bodies`` on ``endpoint``, all of them answered: their answers."""
    c = _client(url)
    data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint,
                               "body": {"model": model, **b}}) + "\n"
                   for i, b in enumerate(bodies)).encode()  # fmt: skip
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=endpoint,  # type: ignore[arg-type]
                         completion_window="24h")  # fmt: skip
    done = _until(c, b.id, ("completed",))
    assert done.request_counts.failed == 0, _lines(c, done.error_file_id)
    return [x["response"]["body"] for x in _lines(c, done.output_file_id)]


@pytest.mark.parametrize("env", ["reference"], indirect=True)
def test_scores_and_reranks_in_batches(deployment: tuple[str, Proc], tiny_model_dir: Path) -> None:
    """vLLM's scoring endpoints batch too (its run_batch takes them): each line's answer
    is what the endpoint itself answers."""
    url, _ = deployment
    docs = ["cats eat fish", "the market fell"]
    body = {"text_1": "what do cats eat?", "text_2": docs}
    (scored,) = _run_batch(url, tiny_model_dir.name, "/v1/score", [body])
    direct = httpx.post(f"{url}/v1/score", json=body, timeout=60).json()
    assert [d["score"] for d in scored["data"]] == [d["score"] for d in direct["data"]]
    rerank = {"query": "what do cats eat?", "documents": docs, "top_n": 1}
    (ranked,) = _run_batch(url, tiny_model_dir.name, "/v1/rerank", [rerank])
    best = max(range(2), key=lambda i: direct["data"][i]["score"])
    assert [x["index"] for x in ranked["results"]] == [best]


def test_a_batch_survives_a_runner_restart_and_a_cancel_keeps_what_was_answered(
    deployment: tuple[str, Proc], env: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, runner = deployment
    c = _client(url)
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 40))),
                       purpose="batch")  # fmt: skip
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, 60,
             "a few requests answered")  # fmt: skip
    runner.popen.send_signal(signal.SIGTERM)  # a warm shutdown: it hands the batch on
    assert runner.popen.wait(60) == 0
    assert not _runners(env)  # it said it left
    mid = c.batches.retrieve(b.id)
    assert mid.status == "in_progress" and mid.request_counts.completed < 40
    second = spawn("batch-runner-2", [str(BIN / "conveyor"), "batch-runner"], env, tmp_path)
    try:
        wait_for(lambda: _runners(env), 60, "the second batch runner", [second])
        done = _until(c, b.id, ("completed",))
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        assert len({x["custom_id"] for x in out}) == len(out) == 40  # each exactly once
        assert done.request_counts.completed == 40 and done.error_file_id is None
        # a cancel: the runner stops sending, the answers so far are the output
        b2 = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
        wait_for(lambda: c.batches.retrieve(b2.id).request_counts.completed >= 3, 60,
                 "a few requests of the second batch")  # fmt: skip
        assert c.batches.cancel(b2.id).status == "cancelling"
        stopped = _until(c, b2.id, ("cancelled",))
        kept = _lines(c, stopped.output_file_id)
        assert 3 <= len(kept) == stopped.request_counts.completed < 40
    finally:
        second.stop()


def test_a_batch_survives_a_killed_runner_once_its_lease_lapses(
    deployment: tuple[str, Proc], env: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The runner's process group SIGKILLed mid-batch (an OOM kill: no warm shutdown, its
    lease left behind, its task message unacked): nobody touches the batch while the dead
    runner's lease lives, then one of two new runners takes it within the lease + the
    recovery period and finishes it; copies of the batch's task (what the broker delivers
    again after its visibility timeout) find it held and drop out. Every request is
    answered exactly once, and the API got each once plus at most the ones in flight at the
    kill: no two runners sent the same requests."""
    url, runner = deployment
    c = _client(url)
    r = redis.Redis.from_url(env["CONVEYOR_REDIS_URL"], decode_responses=True)
    n = 60  # ~0.1 s a request, 2 at a time: ~3 s of work
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, n))),
                       purpose="batch")  # fmt: skip
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    answered = lambda: r.hlen(results_key(b.id, "out"))  # noqa: E731
    wait_for(lambda: answered() >= 10, 60, "a few requests answered", [runner])
    dead = r.get(lease_key(b.id))
    assert dead and dead.startswith(f"batch-{runner.popen.pid}@"), dead  # it runs the batch
    os.killpg(runner.popen.pid, signal.SIGKILL)  # the worker and anything it started
    killed = time.monotonic()
    assert runner.popen.wait(10) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(runner.popen.pid, 0)  # nothing of its group survives
    mid = answered()
    assert 10 <= mid < n and c.batches.retrieve(b.id).status == "in_progress"
    assert r.get(lease_key(b.id)) == dead  # a SIGKILL frees nothing: the lease must lapse

    celery_at(env["CONVEYOR_REDIS_URL"])
    run_batch.apply_async((b.id,), queue=queue(BATCH_QUEUE))  # a copy while the lease lives
    second, third = (spawn(f"batch-runner-{i}", [str(BIN / "conveyor"), "batch-runner"], env,
                           tmp_path) for i in (2, 3))  # fmt: skip
    try:
        wait_for(lambda: _runners(env) >= 2, 60, "two new batch runners", [second, third])
        # while the dead runner's lease lives, nobody sends the batch's requests
        while (held := r.get(lease_key(b.id))) == dead:
            assert answered() == mid, "a runner took a batch whose lease was still held"
            assert time.monotonic() - killed < LEASE_S + 5, "the killed runner's lease lives on"
            time.sleep(0.05)
        wait_for(lambda: answered() > mid, LEASE_S + RECOVER_S + 30,
                 "a new runner answering the batch's requests", [second, third])  # fmt: skip
        took = time.monotonic() - killed
        assert LEASE_S * 0.5 < took < LEASE_S + RECOVER_S + 30, took
        holder = r.get(lease_key(b.id))
        assert holder and holder not in (dead, "queued"), (held, holder)
        run_batch.apply_async((b.id,), queue=queue(BATCH_QUEUE))  # a copy while it runs
        done = _until(c, b.id, ("completed",), timeout=60)
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
        assert len({x["custom_id"] for x in out}) == len(out) == n  # each exactly once
        for x in out:
            body = x["response"]["body"]
            assert x["error"] is None and x["response"]["status_code"] == 200
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
            assert isinstance(body["choices"][0]["message"]["content"], str)
        assert done.error_file_id is None
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        wait_for(lambda: not r.exists(lease_key(b.id)), 10, "the lease freed")
        # the API's own count: each request once, plus those in flight at the kill (their
        # answers died with the runner); a second runner on the batch would add dozens
        sent = _chat_requests(url)
        assert n <= sent <= n + IN_FLIGHT, sent
        # the copy sent while a runner held the batch dropped out; the two runners' scans
        # queued the batch once at most (none when the first copy came after the lease)
        logs = lambda: second.log.read_text() + third.log.read_text()  # noqa: E731
        queued = lambda: logs().count("nobody runs it; queued again")  # noqa: E731
        wait_for(lambda: logs().count("succeeded in") == 2 + queued(), 10,
                 "each task of the batch (two copies, the scans' one) run once")  # fmt: skip
        assert queued() <= 1 and "'held elsewhere'" in logs(), logs()
    finally:
        second.stop()
        third.stop()
    print(f"killed runner's batch taken over {took:.1f} s after the kill (lease {LEASE_S} s)")


def test_a_stalled_runner_that_lost_its_lease_stops_sending(
    deployment: tuple[str, Proc], env: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The runner frozen (SIGSTOP: a swapped-out or paused host) past its lease: a second
    runner takes the batch; the first, thawed, finds its lease gone and stops sending, and
    frees nothing of the second's: every request answered once in the output, the API sent
    each once plus at most the first runner's requests in flight when it froze."""
    url, runner = deployment
    c = _client(url)
    r = redis.Redis.from_url(env["CONVEYOR_REDIS_URL"], decode_responses=True)
    n = 60
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, n))),
                       purpose="batch")  # fmt: skip
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    wait_for(lambda: r.hlen(results_key(b.id, "out")) >= 10, 60, "a few requests answered",
             [runner])  # fmt: skip
    frozen = r.get(lease_key(b.id))
    os.killpg(runner.popen.pid, signal.SIGSTOP)
    second = spawn("batch-runner-2", [str(BIN / "conveyor"), "batch-runner"], env, tmp_path)
    try:
        took = lambda: r.get(lease_key(b.id)) not in (frozen, "queued", None)  # noqa: E731
        wait_for(took, LEASE_S + RECOVER_S + 30, "the second runner holding the batch", [second])
        os.killpg(runner.popen.pid, signal.SIGCONT)  # mid-batch for the second runner
        done = _until(c, b.id, ("completed",), timeout=60)
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
        assert len(out) == n and done.request_counts.completed == n
        sent = _chat_requests(url)
        assert n <= sent <= n + IN_FLIGHT, sent
        wait_for(lambda: "lease lost" in runner.log.read_text(), 10,
                 "the thawed runner giving the batch up", [runner])  # fmt: skip
        assert runner.popen.poll() is None  # it lives on, and serves other batches
    finally:
        os.killpg(runner.popen.pid, signal.SIGCONT)
        second.stop()


def _chat_requests(url: str) -> int:
    """conveyor_requests_total for chat completions, every status."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("conveyor_requests_total{") and '"/v1/chat/completions"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_a_batch_survives_a_restart_of_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``conveyor serve`` stopped (SIGINT) mid-batch and started again on the same state:
    the batch completes with every request answered exactly once (its embedded Redis keeps
    an append-only file: CONVEYOR_REDIS_APPENDONLY)."""
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__DECODE_STEP_MS="10",
               CONVEYOR_MOCK__SPEEDUP="1", CONVEYOR_HEARTBEAT_S="0.5",
               CONVEYOR_SERVE_STATE_DIR=str(tmp_path / "state"),
               CONVEYOR_FILES_DIR=str(tmp_path / "files"), CONVEYOR_BATCH_MAX_IN_FLIGHT="2",
               CONVEYOR_REDIS_APPENDONLY="true")  # fmt: skip
    argv = [str(BIN / "conveyor"), "serve", "--model", str(tiny_model_dir), "--port",
            str(api_port), "--flower-port", str(flower_port), "--redis-port", str(redis_port),
            "--no-flower"]  # fmt: skip
    url = f"http://127.0.0.1:{api_port}"
    c = _client(url)

    def up(name: str) -> Proc:
        serve = spawn(name, argv, env, tmp_path)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 120,
                 "serve healthy", [serve])  # fmt: skip
        return serve

    serve = up("serve-1")
    try:
        f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 40))),
                           purpose="batch")  # fmt: skip
        wait_for(lambda: _try_create(c, f.id) is not None, 60, "a live batch runner", [serve])
        b = _created[-1]
        wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, 60,
                 "a few requests answered", [serve])  # fmt: skip
        assert c.batches.retrieve(b.id).request_counts.completed < 40  # mid-batch
        serve.popen.send_signal(signal.SIGINT)
        assert serve.popen.wait(90) == 0, serve.tail()
        serve = up("serve-2")
        done = _until(c, b.id, ("completed",), timeout=120)
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        assert len(out) == 40 and done.error_file_id is None, done
    finally:
        serve.stop(signal.SIGINT)


_created: list = []


def _try_create(c: openai.OpenAI, file_id: str) -> object | None:
    """Create the batch once a runner is live (503 until then)."""
    try:
        b = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    except openai.InternalServerError:
        return None
    _created.append(b)
    return b
