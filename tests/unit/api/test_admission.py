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
