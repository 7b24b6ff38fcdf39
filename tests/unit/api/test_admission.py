"""api.admission: the wait for a worker under its cap goes by priority (vLLM's: lower
first), then by arrival; a new request jumps only waiters of a higher value."""

from __future__ import annotations

import asyncio

from api.admission import Admission
from api.metrics import ApiMetrics
from tasks.router import WorkersBusy


class Slots:
    """Stands for the router's commit: a request gets a slot or WorkersBusy."""

    def __init__(self) -> None:
        self.free = 0
        self.order: list[str] = []

    def attempt(self, name: str):  # type: ignore[no-untyped-def]
        async def go() -> str:
            if self.free <= 0:
                raise WorkersBusy("generate", 1, 1)
            self.free -= 1
            self.order.append(name)
            return name

        return go


async def _admitted_in_order(arrivals: list[tuple[str, int]]) -> list[str]:
    adm = Admission(wait_s=10.0, retry_after_s=1, metrics=ApiMetrics())
    slots = Slots()
    tasks = []
    for name, priority in arrivals:  # all arrive while every worker is full
        tasks.append(asyncio.create_task(adm.admit(slots.attempt(name), priority)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert adm.waiting == len(arrivals)
    for _ in arrivals:  # one slot frees at a time
        slots.free += 1
        adm.notify()
        await asyncio.sleep(0.01)
    assert sorted(await asyncio.gather(*tasks)) == sorted(n for n, _ in arrivals)
    return slots.order


def test_waiters_are_admitted_by_priority_then_arrival() -> None:
    order = asyncio.run(_admitted_in_order(
        [("low-a", 5), ("low-b", 5), ("high", -1), ("mid", 0), ("high-2", -1)]
    ))  # fmt: skip
    assert order == ["high", "high-2", "mid", "low-a", "low-b"]


def test_equal_priorities_are_first_come_first_served() -> None:
    order = asyncio.run(_admitted_in_order([(f"r{i}", 0) for i in range(5)]))
    assert order == ["r0", "r1", "r2", "r3", "r4"]


def test_a_new_request_tries_at_once_only_before_waiters_of_a_higher_value() -> None:
    async def go() -> tuple[bool, bool]:
        adm = Admission(wait_s=10.0, retry_after_s=1, metrics=ApiMetrics())
        slots = Slots()
        low = asyncio.create_task(adm.admit(slots.attempt("low"), 5))
        await asyncio.sleep(0.01)
        slots.free = 1  # a slot frees, the waiter not yet told
        urgent = await adm.admit(slots.attempt("urgent"), 0)  # tries at once, gets it
        slots.free = 1
        same = asyncio.create_task(adm.admit(slots.attempt("same"), 5))  # queues behind
        await asyncio.sleep(0.01)
        first_in_line = not same.done()
        adm.notify()  # the one free slot goes to the first in line
        await asyncio.sleep(0.01)
        slots.free += 1
        adm.notify()
        await asyncio.gather(low, same)
        return urgent == "urgent" and first_in_line, slots.order == ["urgent", "low", "same"]

    assert asyncio.run(go()) == (True, True)


def test_the_client_limit_counts_every_endpoint_that_starts_work() -> None:
    """A client at its cap gets 429 on every model endpoint (chat, completions, Responses,
    embeddings, pooling, score and rerank, invocations); reads and probes pass."""
    from api.admission import WORK_PATHS, ClientLimitMiddleware

    release = asyncio.Event()
    seen: list[str] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        seen.append(scope["path"])
        if scope["path"] == "/v1/chat/completions":
            await release.wait()  # the request that holds the client's one place
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = ClientLimitMiddleware(app, 1, False, 1, ApiMetrics())

    async def call(path: str) -> int:
        out: list[int] = []

        async def send(msg):  # type: ignore[no-untyped-def]
            if msg["type"] == "http.response.start":
                out.append(msg["status"])

        scope = {"type": "http", "path": path, "method": "POST", "headers": [],
                 "client": ("10.0.0.1", 5)}  # fmt: skip
        await mw(scope, None, send)  # type: ignore[arg-type]
        return out[0]

    async def run() -> dict[str, int]:
        holder = asyncio.create_task(call("/v1/chat/completions"))
        await asyncio.sleep(0.01)
        got = {p: await call(p) for p in sorted(WORK_PATHS - {"/v1/chat/completions"})}
        got |= {p: await call(p) for p in ("/v1/models", "/health", "/v1/responses/resp_1")}
        release.set()
        await holder
        return got

    got = asyncio.run(run())
    assert {p for p, status in got.items() if status == 429} == WORK_PATHS - {
        "/v1/chat/completions"}  # fmt: skip
    assert {"/v1/responses", "/pooling", "/score", "/invocations"} <= WORK_PATHS
    assert got["/v1/models"] == got["/health"] == got["/v1/responses/resp_1"] == 200
