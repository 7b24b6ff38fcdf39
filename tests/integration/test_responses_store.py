"""Stored responses and ``previous_response_id``, through the official client: a turn
continued from a stored response reads exactly as the whole conversation sent at once
(the same prompt tokens, the same greedy output), on any API replica; ``store: false``,
deleted and unknown responses are 404s; retrieve, delete and input_items answer as
OpenAI's do."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.integration.conftest import Cluster, Proc, base_env, start_api

pytestmark = pytest.mark.integration

KW = dict(max_output_tokens=8, temperature=0)


def _items(resp) -> list[dict]:  # type: ignore[no-untyped-def]
    """A response's output items, as a client sends them back as input."""
    return [o.model_dump(exclude_none=True) for o in resp.output]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def replicas(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two more API processes on the cluster's Redis and workers: one with the store (a
    replica of the cluster's API), one without (CONVEYOR_RESPONSES_STORE=false)."""
    logdir = tmp_path_factory.mktemp("store-apis")
    procs: list[Proc] = []
    urls = {}
    for name, extra in (("twin", {}), ("off", {"CONVEYOR_RESPONSES_STORE": "false"})):
        env = base_env(cluster.redis_url, cluster.model_dir, **extra)
        p, url = start_api(f"api-{name}", env, logdir)
        procs.append(p)
        urls[name] = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    yield urls
    for p in procs:
        p.stop()


def test_a_continued_turn_reads_as_the_whole_conversation(cluster: Cluster) -> None:
    """Three turns (the last two on previous_response_id, the third streamed), each equal
    to the stateless request that carries the conversation in ``input``; the first
    turn's instructions are not carried over (OpenAI's rule)."""
    client, model = cluster.client(max_retries=0), cluster.model_name
    r1 = client.responses.create(model=model, input="Tell me about cats.",
                                 instructions="Answer in one word.", **KW)  # fmt: skip
    assert r1.store is True and r1.previous_response_id is None
    r2 = client.responses.create(model=model, input="And dogs?", previous_response_id=r1.id,
                                 **KW)  # fmt: skip
    assert r2.previous_response_id == r1.id
    history = [_user("Tell me about cats."), *_items(r1), _user("And dogs?")]
    want = client.responses.create(model=model, input=history, store=False, **KW)  # type: ignore[arg-type]
    assert want.store is False
    assert r2.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert r2.output_text == want.output_text
    # the first turn's instructions would have added tokens had they been carried
    with_sys = client.responses.create(model=model, input=history, store=False,
                                       instructions="Answer in one word.", **KW)  # type: ignore[arg-type]  # fmt: skip
    assert with_sys.usage.input_tokens > r2.usage.input_tokens  # type: ignore[union-attr, operator]

    # streamed: stored before its last event, so the next turn finds it at once
    with client.responses.stream(model=model, input="Which is older?",
                                 previous_response_id=r2.id, **KW) as s:  # type: ignore[arg-type]  # fmt: skip
        r3 = s.get_final_response()
    r4 = client.responses.create(model=model, input="Why?", previous_response_id=r3.id, **KW)
    history += [*_items(r2), _user("Which is older?"), *_items(r3), _user("Why?")]
    want = client.responses.create(model=model, input=history, store=False, **KW)  # type: ignore[arg-type]
    assert r4.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert r4.output_text == want.output_text


def test_retrieve_input_items_and_delete(cluster: Cluster) -> None:
    client, model = cluster.client(max_retries=0), cluster.model_name
    inp = [_user("one"), {"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "two"}]}]  # fmt: skip
    r = client.responses.create(model=model, input=inp, **KW)  # type: ignore[arg-type]
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()

    items = client.responses.input_items.list(r.id)
    texts = [i.content[0].text for i in items.data]  # type: ignore[union-attr]
    assert texts == ["two", "one"]  # newest first, as OpenAI lists them
    assert all(i.id for i in items.data) and len({i.id for i in items.data}) == 2
    page = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.content[0].text for i in page.data] == ["one"] and page.has_more  # type: ignore[union-attr]
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[0].id)
    assert [i.content[0].text for i in rest.data] == ["two"] and not rest.has_more  # type: ignore[union-attr]

    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="x", previous_response_id=r.id, **KW)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_unstored_and_unknown_responses_are_404(cluster: Cluster) -> None:
    client, model = cluster.client(max_retries=0), cluster.model_name
    r = client.responses.create(model=model, input="not kept", store=False, **KW)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    for prev in (r.id, "resp_nothing", "chatcmpl-123"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=model, input="x", previous_response_id=prev, **KW)
        assert e.value.body["param"] == "previous_response_id", prev  # type: ignore[index]
    # a stored response is not a stream to replay
    stored = client.responses.create(model=model, input="kept", **KW)
    with pytest.raises(openai.BadRequestError):
        client.get(
            f"/responses/{stored.id}", cast_to=object, options={"params": {"stream": "true"}}
        )


def test_a_conversation_goes_on_on_another_replica(cluster: Cluster, replicas: dict) -> None:
    """Stored in Redis: a turn on one API process continues on another; a conversation
    whose earlier turn was deleted cannot be continued (404 naming it)."""
    a, b, model = cluster.client(max_retries=0), replicas["twin"], cluster.model_name
    r1 = a.responses.create(model=model, input="Hello there.", **KW)
    r2 = b.responses.create(model=model, input="Go on.", previous_response_id=r1.id, **KW)
    want = b.responses.create(model=model, input=[_user("Hello there."), *_items(r1),
                                                  _user("Go on.")], store=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert r2.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert r2.output_text == want.output_text
    assert b.responses.retrieve(r1.id).model_dump() == r1.model_dump()
    a.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.create(model=model, input="More.", previous_response_id=r2.id, **KW)
    assert r1.id in e.value.body["message"]  # type: ignore[index]


def test_with_the_store_off_nothing_is_kept(cluster: Cluster, replicas: dict) -> None:
    off, model = replicas["off"], cluster.model_name
    r = off.responses.create(model=model, input="hi", **KW)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        off.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        off.responses.create(model=model, input="x", previous_response_id=r.id, **KW)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
