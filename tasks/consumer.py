"""The worker's Celery consumer: Celery's own, sending its task events in batches.

Celery buffers a worker's task events (``task-received``, ``task-started``,
``task-succeeded``, ...) and flushes the buffer as one ``task.multi`` message, but it asks
for a flush after every event, so on the Redis transport a request costs one ``PUBLISH``
round trip per event (three for a request that succeeds). On a host where the worker
shares its core with the API and Redis, those round trips are a fifth of the worker's CPU
per request (a py-spy profile at 16 streams), and each one lets Redis and whatever it
wakes run ahead of the task intake. Here the flush waits until ``EVENT_FLUSH_S`` has passed
since the last one, so a burst of events goes out as one message. Flower and other event
consumers see each event at most that much later; the events themselves are unchanged.
Worker heartbeats are not buffered and still go out on time.

Selected with Celery's ``worker_consumer`` setting (:func:`tasks.app.configure`).
"""

from __future__ import annotations

import time

from celery.worker.consumer import Consumer as CeleryConsumer

EVENT_FLUSH_S = 0.05  # the longest a buffered task event waits for company


class Consumer(CeleryConsumer):
    _last_flush = 0.0
    _flush_scheduled = False

    def _flush_events(self) -> None:
        # Runs on the event loop's thread (Celery schedules it with ``hub.call_soon``;
        # the timer below fires there too), so no lock is needed for the two flags.
        wait = self._last_flush + EVENT_FLUSH_S - time.monotonic()
        if wait > 0 and self.hub is not None:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.hub.call_later(wait, self._flush_due)
            return
        self._last_flush = time.monotonic()
        super()._flush_events()

    def _flush_due(self) -> None:
        self._flush_scheduled = False
        self._flush_events()

    def shutdown(self) -> None:
        # events still buffered go out before the dispatcher closes
        if self.event_dispatcher is not None:
            self.event_dispatcher.flush()
        super().shutdown()
