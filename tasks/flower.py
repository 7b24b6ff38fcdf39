"""Flower with Conveyor's Celery app, listing the stage queues the worker registry knows.

``conveyor flower`` runs ``celery -A tasks.flower flower ...``. Importing this module
configures Conveyor's app for Flower: the broker from the settings, the pool queues as
its ``task_queues``, and kombu's stock Redis transport (Flower reads queue lengths itself,
from the broker URL's scheme, which the fast-path transport would rename).

Flower's broker page and ``GET /api/queues/length`` show the queues the workers reported
(remote control ``active_queues``) when Flower last inspected them: at its start, and
when someone refreshes the workers page. A worker that joins later is missing, one that
left stays for good, and before any worker answers Flower shows the app's queues. Flower
has no setting for that list, so :func:`install` replaces the one method that computes
it, ``BaseHandler.get_active_queue_names``, with the registry's view
(:func:`tasks.queues.snapshot`), read at every request: every pool queue, each live
worker's own queue, and a departed worker's until it is empty. Flower still reads the
lengths itself (its ``Broker.queues``), so its page and API are otherwise unchanged.

That method is Flower's internal API: it is replaced on flower 2.2.x only (the version this
was written and tested against). Any other version, ``CONVEYOR_FLOWER_REGISTRY_QUEUES=false``
or a Redis error while reading the registry leave Flower's stock list (the suite runs
that path too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import flower
import redis
from flower.views import BaseHandler

from tasks.app import configure
from tasks.queues import queue_names, snapshot
from tasks.settings import Settings, get_settings

log = logging.getLogger(__name__)

TESTED_FLOWER = "2.2."
REDIS_TIMEOUT_S = 2.0  # as Flower's own Redis client: a page never hangs on the broker

_stock: Callable[[BaseHandler], list[str]] = BaseHandler.get_active_queue_names


def install(s: Settings) -> bool:
    """List the registry's queues in Flower (see the module's doc); whether it did."""
    if not s.api.flower_registry_queues:
        return False
    if not flower.__version__.startswith(TESTED_FLOWER):
        log.warning(
            "flower %s: the broker page keeps Flower's own queue list (registry queues are "
            "wired for flower %sx)", flower.__version__, TESTED_FLOWER,
        )  # fmt: skip
        return False
    client = redis.Redis.from_url(
        s.effective_redis_url, socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
    )  # fmt: skip
    mode = s.serving_mode

    def get_active_queue_names(handler: BaseHandler) -> list[str]:
        try:
            return queue_names(snapshot(client, mode))
        except redis.RedisError as e:
            log.warning("worker registry unreadable (%s): Flower's own queue list", e)
            return _stock(handler)

    BaseHandler.get_active_queue_names = get_active_queue_names
    return True


def _flower_app(s: Settings):
    app = configure(s.model_copy(update={"broker_fastpath": False}))
    install(s)
    return app


app = _flower_app(get_settings())
