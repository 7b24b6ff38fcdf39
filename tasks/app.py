"""The Celery app: broker, serializer, explicit queues, acknowledgement policy.

Queues are declared, never created on demand (``task_create_missing_queues`` off): each
pool has a shared queue (``generate``) and each worker its own (``generate.<worker_id>``),
both direct-routed by name. Stage tasks ack late with prefetch 1 and keep no results — the
tokens travel over Redis pub/sub, not through a result backend.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from cluster.queues import pool_queue
from tasks.settings import Settings, get_settings

app = Celery("conveyor", include=["tasks.stages", "tasks.batches"])


def queue(name: str) -> Queue:
    """A direct queue bound to an exchange of the same name (routing key = name)."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def route_to(name: str) -> dict:
    """Signature options that send a task to queue ``name`` by its exchange and routing key:
    JSON-safe (they travel inside a chain's message, unlike a ``Queue`` object) and valid
    with ``task_create_missing_queues`` off. The consuming worker declared the binding."""
    return {"exchange": name, "routing_key": name}


def declare_queues(names: list[str], retry_policy: Mapping[str, Any] | None = None) -> None:
    """Make sure queues (and their bindings) exist in the broker. ``retry_policy`` (the
    keys of Celery's publish retry policy: max_retries, interval_start/step/max) bounds
    the connection attempts; by default they back off for seconds."""
    with app.connection_for_write() as conn:
        if retry_policy is not None:
            conn.ensure_connection(**retry_policy)
        channel = conn.default_channel
        for name in names:
            queue(name)(channel).declare()


def broker_tls(url: str) -> dict | None:
    """TLS options for a ``rediss://`` broker whose URL names none: verify the server's
    certificate (against the system's CAs), as redis-py does. Kombu would connect without
    any check there (``CERT_NONE``), and our transport, not named by the scheme, without
    TLS at all. ``ssl_*`` options in the URL (``?ssl_ca_certs=/path/ca.pem``) are kombu's
    to read and win."""
    if not url.startswith("rediss://") or "ssl_" in url.partition("?")[2]:
        return None
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED}


def configure(settings: Settings | None = None, extra_queues: Sequence[str] = ()) -> Celery:
    s = settings or get_settings()
    names = [*(pool_queue(p) for p in s.pools), *extra_queues]
    # the fast path: kombu's Redis transport, minus its per-message costs (tasks.broker),
    # and Celery's consumer sending task events in batches (tasks.celery_ext); off: stock
    fast = s.broker_fastpath
    url = s.effective_redis_url
    scheme = url.partition("://")[0]
    app.conf.update(
        broker_url=url,
        broker_transport="tasks.broker:Transport"
        if fast and scheme in ("redis", "rediss")
        else None,  # fmt: skip
        broker_use_ssl=broker_tls(url),
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_create_missing_queues=False,
        task_queues=[queue(n) for n in names],
        task_default_queue=pool_queue(s.pools[0]),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        worker_consumer="tasks.celery_ext:Consumer" if fast else "celery.worker.consumer:Consumer",
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_pool_limit=32,
    )
    return app
