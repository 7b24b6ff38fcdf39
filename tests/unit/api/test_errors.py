"""api.errors' handlers: what a route's exception becomes on the wire."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.errors import install_error_handlers


def _client(exc: Exception) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    async def fail() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("exc", [RedisConnectionError("Error 111 connecting"),
                                 RedisTimeoutError("Timeout reading")])  # fmt: skip
def test_redis_away_is_a_retryable_503_in_the_clients_shape(exc: Exception) -> None:
    c = _client(exc)
    r = c.post("/v1/chat/completions")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "redis_unavailable" and err["type"] == "server_error"
    assert str(exc) in err["message"]
    r = c.post("/v1/messages")  # Anthropic's shape on its path
    assert r.status_code == 503 and r.json()["type"] == "error"


def test_any_other_exception_stays_an_internal_error() -> None:
    r = _client(ResponseError("WRONGTYPE")).post("/v1/chat/completions")
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: ResponseError"
