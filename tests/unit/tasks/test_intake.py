"""tasks.intake and WorkerRuntime.begin: a generate or prefill request is started in the
engine as its message arrives, and its task then waits for that run.

Celery's own strategy, the message and the engine client are stand-ins here; the real
pipeline (a worker's log saying its requests were begun on receipt) is in
tests/integration/test_openai_api.py."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest

import tasks.celery_ext as intake
from kvbm.protocol import Sampling, StagePayload, cancelled_key
from workers import runtime as runtime_mod
from workers.engine_ipc import Completion, Generate, Prefill, Run
from workers.engine_proc import _Waiter
from workers.runtime import WorkerRuntime

PAYLOAD = {"request_id": "cmpl-x", "model": "m", "prompt_token_ids": [5, 6, 7],
           "sampling": {"temperature": 0}, "created": 0.0}  # fmt: skip


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[Run] = []
        self.aborted: list[str] = []

    def run(self, cmd: Run) -> _Waiter:
        self.calls.append(cmd)
        w = _Waiter()
        w.result = Completion(cmd.request_id, "length", prompt_tokens=3, completion_tokens=2)
        w.event.set()
        return w

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def runtime() -> WorkerRuntime:
    rt = WorkerRuntime.__new__(WorkerRuntime)  # the request bookkeeping only
    rt.engine = FakeEngine()  # type: ignore[assignment]
    rt.redis = SimpleNamespace(exists=lambda key: 0)  # type: ignore[assignment]
    rt.worker_id = "w"
    rt._begun = {}
    rt._begun_lock = threading.Lock()
    rt._request_log = logging.INFO
    return rt


@pytest.fixture
def rt():  # type: ignore[no-untyped-def]
    r = runtime()
    runtime_mod.set_runtime(r)
    yield r
    runtime_mod.set_runtime(None)


def message(payload: dict = PAYLOAD, **headers: object) -> SimpleNamespace:
    body = json.dumps([[payload], {}, {}]).encode()
    return SimpleNamespace(headers={"id": payload.get("request_id"), **headers},
                           content_type="application/json", body=body)  # fmt: skip


def strategy(monkeypatch, handler=None, rate_limit=None, name="conveyor.generate"):  # type: ignore[no-untyped-def]
    seen: list = []

    def default(task, app, consumer, **kw):  # type: ignore[no-untyped-def]
        def handle(message, body, ack, reject, callbacks, **kw):  # type: ignore[no-untyped-def]
            seen.append(message)
            if handler is not None:
                handler(message)

        return handle

    monkeypatch.setattr(intake, "default_strategy", default)
    task = SimpleNamespace(name=name, rate_limit=rate_limit)
    return intake.begin_on_receipt(task, None, None), seen


def test_the_request_starts_before_celery_handles_the_message(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    started_first = []
    on_message, seen = strategy(monkeypatch, handler=lambda m: started_first.append(
        len(rt.engine.calls)))  # fmt: skip
    msg = message()
    on_message(msg, None, None, None, [])
    assert seen == [msg] and started_first == [1]
    # the payload whole, as the task would have it (defaults filled in), on the pipe
    assert rt.engine.calls == [Generate(StagePayload.model_validate(PAYLOAD))]
    assert rt.engine.calls[0].payload.sampling == Sampling(temperature=0)
    # the task then waits for that run: no second submit
    out = rt.generate(Generate(StagePayload.model_validate(PAYLOAD)))
    assert out.completion_tokens == 2 and len(rt.engine.calls) == 1
    assert rt._begun == {}


def test_a_prefill_message_starts_a_prefill(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    on_message, _ = strategy(monkeypatch, name="conveyor.prefill")
    on_message(message(), None, None, None, [])
    assert [type(c) for c in rt.engine.calls] == [Prefill]


def test_a_message_delivered_twice_starts_one_run(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    on_message, _ = strategy(monkeypatch)
    on_message(message(), None, None, None, [])
    on_message(message(), None, None, None, [])
    assert len(rt.engine.calls) == 1


@pytest.mark.parametrize(
    "msg",
    [
        message(eta="2030-01-01T00:00:00"),  # Celery holds it back: so do we
        message(expires="2030-01-01T00:00:00"),
        message(redelivered=True),  # kombu's mark: its task checks the cancelled key first
        message({**PAYLOAD, "prompt_token_ids": []}),  # invalid: the task reports it
        SimpleNamespace(headers={"id": "x"}, content_type="application/json", body=b"{"),
        SimpleNamespace(
            headers={"id": "x"}, content_type="application/x-python-serialize", body=b"\x80"
        ),  # fmt: skip
    ],
)
def test_messages_left_to_celery_alone(monkeypatch, rt, msg) -> None:  # type: ignore[no-untyped-def]
    on_message, seen = strategy(monkeypatch)
    on_message(msg, None, None, None, [])
    assert seen == [msg] and rt.engine.calls == []


@pytest.mark.parametrize("stage", ["generate", "prefill"])
def test_a_task_not_begun_for_an_abandoned_request_never_reaches_the_engine(rt, stage) -> None:  # type: ignore[no-untyped-def]
    rt.redis = SimpleNamespace(exists=lambda key: int(key == cancelled_key("cmpl-x")))
    run = {"generate": Generate, "prefill": Prefill}[stage]
    out = getattr(rt, stage)(run(StagePayload.model_validate(PAYLOAD)))
    assert out.finish_reason == "abort" and rt.engine.calls == [] and rt.engine.aborted == []
    # one the API still waits for
    rt.generate(Generate(StagePayload.model_validate({**PAYLOAD, "request_id": "cmpl-y"})))
    assert [(type(c), c.request_id) for c in rt.engine.calls] == [(Generate, "cmpl-y")]


def test_a_rate_limited_task_keeps_celerys_strategy(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    on_message, seen = strategy(monkeypatch, rate_limit="10/s")
    on_message(message(), None, None, None, [])
    assert len(seen) == 1 and rt.engine.calls == []


def test_a_revoked_task_has_its_request_aborted(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(intake.worker_state, "revoked", {"cmpl-x"})
    on_message, _ = strategy(monkeypatch)
    on_message(message(), None, None, None, [])
    assert len(rt.engine.calls) == 1 and rt.engine.aborted == ["cmpl-x"]
    assert rt._begun == {}


def test_a_message_celery_fails_on_has_its_request_aborted(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    def boom(m):  # type: ignore[no-untyped-def]
        raise RuntimeError("refused")

    on_message, _ = strategy(monkeypatch, handler=boom)
    with pytest.raises(RuntimeError):
        on_message(message(), None, None, None, [])
    assert rt.engine.aborted == ["cmpl-x"] and rt._begun == {}


def test_an_engine_that_refuses_leaves_the_request_to_its_task(monkeypatch, rt) -> None:  # type: ignore[no-untyped-def]
    def dead(*a: object) -> None:
        raise OSError("engine process unreachable")

    rt.engine.run = dead
    on_message, seen = strategy(monkeypatch)
    on_message(message(), None, None, None, [])
    assert len(seen) == 1 and rt._begun == {}
