"""A Dynamo client's ``nvext`` through the real pipeline (the session cluster: redis-server,
``conveyor worker`` processes, the API over HTTP, the official openai client): the prompt
as ``token_data`` gives the answer of the text it tokenizes to, ``greed_sampling`` the
greedy answer, ``backend_instance_id`` pins the request to that worker (an unknown one is
the 400 a pin gets), and fields without a counterpart are refused naming them."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "Name three rivers."}]


def test_token_data_and_greed_sampling_give_the_plain_answer(cluster: Cluster) -> None:
    c, model = cluster.client(max_retries=0), cluster.model_name
    greedy = c.chat.completions.create(model=model, messages=MSGS, max_tokens=8,  # type: ignore[arg-type]
                                       temperature=0)  # fmt: skip
    ids = httpx.post(f"{cluster.url}/tokenize", json={"model": model, "messages": MSGS}).json()
    nv: dict[str, Any] = {"greed_sampling": True, "token_data": ids["tokens"]}
    other = [{"role": "user", "content": "Something else entirely."}]  # token_data wins
    got = c.chat.completions.create(model=model, messages=other, max_tokens=8,  # type: ignore[arg-type]
                                    temperature=1.3, extra_body={"nvext": nv})  # fmt: skip
    assert got.choices[0].message.content == greedy.choices[0].message.content
    assert got.usage.prompt_tokens == ids["count"]  # type: ignore[union-attr]

    comp = c.completions.create(model=model, prompt="ignored", max_tokens=6, temperature=0,
                                extra_body={"nvext": {"token_data": [1, 72, 301, 44]}})  # fmt: skip
    want = c.completions.create(model=model, prompt=[1, 72, 301, 44], max_tokens=6,
                                temperature=0)  # fmt: skip
    assert comp.choices[0].text == want.choices[0].text


def test_backend_instance_id_pins_the_worker(cluster: Cluster) -> None:
    c, model = cluster.client(max_retries=0), cluster.model_name
    for w in ("itest-w0", "itest-w1"):  # the session cluster's workers
        r = httpx.post(f"{cluster.url}/v1/completions", json={
            "model": model, "prompt": "hi", "max_tokens": 2,
            "nvext": {"backend_instance_id": w}})  # fmt: skip
        assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="hi", max_tokens=2,
                             extra_body={"nvext": {"backend_instance_id": 12345}})  # fmt: skip
    assert e.value.body["code"] == "worker_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
                                  extra_body={"nvext": {"extra_fields": ["timing"]}})  # fmt: skip
    assert e.value.body["param"] == "nvext.extra_fields"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="x", max_tokens=2,
                             extra_body={"nvext": {"token_data": [1, 10**9]}})  # fmt: skip
    assert e.value.body["param"] == "nvext.token_data"  # type: ignore[index]
