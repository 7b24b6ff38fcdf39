"""tasks.consumer: the worker's task events are flushed at most once per EVENT_FLUSH_S
(a fake event loop and dispatcher; the real pipeline is in
tests/integration/test_task_events.py)."""

from __future__ import annotations

import time

from tasks.celery_ext import EVENT_FLUSH_S, Consumer
from tests.fakes import FakeHub


class FakeDispatcher:
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def consumer(hub: FakeHub | None) -> Consumer:
    c = Consumer.__new__(Consumer)  # the flush logic only; Celery's set-up is not needed
    c.hub = hub
    c.event_dispatcher = FakeDispatcher()
    return c


def test_a_burst_of_events_is_flushed_once_now_and_once_after_the_window() -> None:
    hub = FakeHub()
    c = consumer(hub)
    c._flush_events()  # the first event goes out at once
    assert c.event_dispatcher.flushes == 1 and hub.timers == []
    for _ in range(5):  # more within the window: one flush scheduled for its end
        c._flush_events()
    assert c.event_dispatcher.flushes == 1
    assert len(hub.timers) == 1
    delay, fire = hub.timers[0]
    assert 0 < delay <= EVENT_FLUSH_S
    time.sleep(delay)
    fire()
    assert c.event_dispatcher.flushes == 2
    c._flush_events()  # a new window: scheduled again, not sent at once
    assert c.event_dispatcher.flushes == 2 and len(hub.timers) == 2


def test_a_timer_that_fires_early_reschedules_rather_than_drops() -> None:
    hub = FakeHub()
    c = consumer(hub)
    c._flush_events()
    c._flush_events()
    hub.timers.pop()[1]()  # fired before the window ended
    assert c.event_dispatcher.flushes == 1
    assert len(hub.timers) == 1  # still owed


def test_without_an_event_loop_every_flush_goes_out() -> None:
    c = consumer(None)
    for _ in range(3):
        c._flush_events()
    assert c.event_dispatcher.flushes == 3
