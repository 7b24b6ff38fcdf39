"""Kombu's Redis transport, keeping one client per channel.

Kombu's Redis channel builds a new ``redis.Redis`` for every publish, ack and event it
sends (``Channel.conn_or_acquire``), and redis-py fills a fresh table of some 200 response
callbacks each time: ~0.1 ms of CPU per call, several calls per request on both the API
(send, task-sent event) and the worker (task-received/started/succeeded events, ack). A
profile of a worker at 4 concurrent streams put 17% of its CPU there. The client only wraps
the channel's connection pool, which is thread-safe, so one per channel serves them all.

Used for ``redis://`` brokers (``tasks.app.configure``); other schemes (``rediss://``,
whose TLS set-up kombu keys on the scheme, and ``sentinel://``) keep kombu's own transport.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _sync_client = None

    def _create_client(self, asynchronous: bool = False):  # type: ignore[no-untyped-def]
        if asynchronous:  # the consumer's BRPOP client: kombu keeps that one itself
            return super()._create_client(asynchronous=True)
        if self._sync_client is None:
            self._sync_client = super()._create_client()
        return self._sync_client

    def close(self) -> None:
        self._sync_client = None
        super().close()


class Transport(kombu_redis.Transport):
    Channel = Channel
