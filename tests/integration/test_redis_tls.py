"""Redis over TLS with a password, end to end (a real redis-server with only a TLS port, a
throwaway CA made here with openssl, a real mock-engine worker and API, the official
openai client): ``CONVEYOR_REDIS_URL=rediss://:<password>@host:port/0?ssl_ca_certs=ca.pem``
carries the Celery broker (the fast-path transport, and kombu's stock one), the token
stream (pub/sub), the router's scripts, the API's own RESP connection and the workers'
frames, heartbeats and KV events. A certificate from another CA is refused; the password
never reaches the logs."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tasks.app import broker_tls
from tests.integration.conftest import (
    Proc,
    base_env,
    free_port,
    spawn,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.integration.test_redis_restart import _stream
from tests.tls_util import make_ca, make_server_cert

pytestmark = pytest.mark.integration

PASSWORD = "tls-secret-5f2b"
PREFIX = "A prompt long enough to fill whole blocks of sixteen tokens, twice over at least. " * 2


@dataclass
class TLSRedis:
    url: str  # rediss://, password, our CA
    port: int
    ca: Path
    other_ca: Path
    proc: Proc


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's CA")
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d, "ca")
    other, _ = make_ca(d, "other-ca")
    cert, key = make_server_cert(d, ca)
    port = free_port()
    argv = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
            str(ca[0]), "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "",
            "--appendonly", "no", "--dir", str(d)]  # fmt: skip
    p = spawn("redis-tls", argv, dict(os.environ), d)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca[0]}"
    try:
        wait_for(lambda: redis.Redis.from_url(url).ping(), 10, "redis-server (TLS)", [p])
    except (TimeoutError, RuntimeError) as e:
        p.stop()
        if "tls" in p.tail().lower():
            pytest.skip(f"this redis-server has no TLS: {p.tail(3)}")
        raise e
    yield TLSRedis(url, port, ca[0], other, p)
    p.stop()


def test_plain_and_unverified_connections_are_refused(tls_redis: TLSRedis) -> None:
    """The server speaks only TLS, and a client checking against another CA refuses it;
    a rediss:// broker URL without TLS options still verifies (system CAs)."""
    plain = f"redis://:{PASSWORD}@127.0.0.1:{tls_redis.port}/0"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2).ping()
    wrong = tls_redis.url.replace(str(tls_redis.ca), str(tls_redis.other_ca))
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        redis.Redis.from_url(wrong, socket_timeout=2).ping()
    assert broker_tls(f"rediss://:{PASSWORD}@h:1/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert broker_tls(tls_redis.url) is None  # the URL's own ssl_* options
    assert broker_tls(plain) is None


@pytest.mark.parametrize("fastpath", ["true", "false"])
def test_serving_over_tls_with_a_password(
    tls_redis: TLSRedis, tiny_model_dir: Path, tmp_path: Path, fastpath: str
) -> None:
    redis.Redis.from_url(tls_redis.url).flushdb()
    env = base_env(tls_redis.url, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="10", CONVEYOR_BROKER_FASTPATH=fastpath)  # fmt: skip
    procs = [start_worker("tls-w", "generate", "tls-w", env, tmp_path)]
    try:
        with stop_on_error(*procs):
            api, url = start_api("tls-api", env, tmp_path)
            procs.append(api)
            wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 60,
                     "a live worker over TLS", procs)  # fmt: skip
        model = tiny_model_dir.name
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        # the same long prompt twice: the second finds its blocks cached (KV events and
        # the router's scripts over TLS)
        usage = []
        for _ in range(2):
            out = client.completions.create(model=model, prompt=PREFIX, max_tokens=8,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            assert out.usage.completion_tokens == 8 and out.choices[0].text
            usage.append(out.usage)
        assert usage[1].prompt_tokens_details.cached_tokens >= 32, usage

        async def streams() -> list[tuple[str, str, str | None]]:
            return await asyncio.gather(*(_stream(url, model, f"tls {i}", 24) for i in range(8)))

        for text, reason, err in asyncio.run(streams()):  # token frames over TLS pub/sub
            assert err is None and text and reason == "length", err
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'conveyor_finish_reasons_total{reason="length"} 10.0' in metrics
        for p in procs:  # the password never reaches a log
            assert PASSWORD not in p.log.read_text(errors="replace"), p.name
    finally:
        for p in reversed(procs):
            p.stop()
