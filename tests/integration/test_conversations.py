"""OpenAI's Conversations API through the official client (real redis-server, real
workers, the API over HTTP): create, retrieve, update, delete; items added, listed, paged,
fetched and removed; a response with ``conversation`` reads exactly as the stateless
request carrying the conversation's items in ``input`` (the same prompt tokens, the same
greedy output), its turn joins the conversation once it ends (streamed too, and on
another API replica); errors are OpenAI's 400s and 404s."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.integration.conftest import Cluster, base_env, start_api

pytestmark = pytest.mark.integration

KW = dict(max_output_tokens=8, temperature=0)


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def _as_input(items: list) -> list[dict]:
    """A conversation's items, as a client sends them back in ``input``."""
    return [it.model_dump(exclude_none=True) for it in items]


@pytest.fixture(scope="module")
def twin(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A second API process on the cluster's Redis and workers."""
    env = base_env(cluster.redis_url, cluster.model_dir)
    p, url = start_api("api-conv-twin", env, tmp_path_factory.mktemp("conv"))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    p.stop()


def test_create_retrieve_update_delete(cluster: Cluster) -> None:
    client = cluster.client(max_retries=0)
    conv = client.conversations.create(items=[_user("Hello"), {"role": "assistant",
                                                               "content": "Hi there"}],
                                       metadata={"topic": "greetings"})  # type: ignore[list-item]  # fmt: skip
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "greetings"} and conv.created_at > 0
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = client.conversations.update(conv.id, metadata={"topic": "cats", "k": "v"})
    assert updated.metadata == {"topic": "cats", "k": "v"}
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(it.type, it.role) for it in items] == [("message", "user"),  # type: ignore[union-attr]
                                                    ("message", "assistant")]  # fmt: skip
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Hello"  # type: ignore[union-attr]
    assert items[1].content[0].type == "output_text"  # type: ignore[union-attr]
    gone = client.conversations.delete(conv.id)
    assert (gone.id, gone.deleted, gone.object) == (conv.id, True, "conversation.deleted")
    for call in (lambda: client.conversations.retrieve(conv.id),
                 lambda: client.conversations.delete(conv.id),
                 lambda: client.conversations.items.list(conv.id),
                 lambda: client.conversations.update(conv.id, metadata={}),
                 lambda: client.responses.create(model=cluster.model_name, input="x",
                                                 conversation=conv.id, **KW)):  # type: ignore[arg-type]  # fmt: skip
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert conv.id in e.value.body["message"]  # type: ignore[index]


def test_items_added_paged_fetched_and_removed(cluster: Cluster) -> None:
    client = cluster.client(max_retries=0)
    conv = client.conversations.create()
    added = client.conversations.items.create(conv.id, items=[_user(f"m{i}") for i in range(5)])  # type: ignore[misc]
    ids = [it.id for it in added.data]
    assert len(set(ids)) == 5 and (added.first_id, added.last_id) == (ids[0], ids[-1])
    # newest first by default; asc; after; limit and has_more
    desc = client.conversations.items.list(conv.id, limit=2)
    assert [it.id for it in desc.data] == ids[:-3:-1] and desc.has_more
    page = client.conversations.items.list(conv.id, order="asc", after=ids[1], limit=10)
    assert [it.id for it in page.data] == ids[2:] and not page.has_more
    assert [it.id for it in client.conversations.items.list(conv.id, order="asc")] == ids
    one = client.conversations.items.retrieve(ids[2], conversation_id=conv.id)
    assert one.id == ids[2] and one.content[0].text == "m2"  # type: ignore[union-attr]
    after_delete = client.conversations.items.delete(ids[2], conversation_id=conv.id)
    assert after_delete.id == conv.id
    assert [it.id for it in client.conversations.items.list(conv.id, order="asc")] == \
        ids[:2] + ids[3:]  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(ids[2], conversation_id=conv.id)
    # an item whose id the conversation holds is not added again
    again = client.conversations.items.create(conv.id, items=[{**_user("x"), "id": ids[0]}])  # type: ignore[list-item]
    assert again.data == []


def test_bad_items_and_metadata_are_400(cluster: Cluster) -> None:
    client = cluster.client(max_retries=0)
    cases = [
        (dict(items=[{"type": "web_search_call"}]), "items.0.type"),
        (dict(items=[_user("x")] * 21), "items"),
        (dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (dict(metadata={"k": "v" * 513}), "metadata"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.create(**kw)  # type: ignore[arg-type]
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=cluster.model_name, input="x", conversation=conv.id,
                                previous_response_id="resp_x", **KW)  # type: ignore[arg-type]  # fmt: skip
    assert e.value.body["param"] == "conversation"  # type: ignore[index]


def test_a_response_in_a_conversation_reads_as_the_whole_conversation(
    cluster: Cluster, twin: openai.OpenAI
) -> None:
    """Three turns in one conversation (the second streamed, the third on another API
    replica), each equal to the stateless request carrying the conversation's items; each
    turn's input and output items join the conversation in order, once."""
    client, model = cluster.client(max_retries=0), cluster.model_name
    conv = client.conversations.create(items=[{"role": "system", "content": "Be brief."}])  # type: ignore[list-item]
    r1 = client.responses.create(model=model, input="Tell me about cats.",
                                 conversation=conv.id, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert r1.conversation is not None and r1.conversation.id == conv.id
    want = client.responses.create(model=model, store=False, **KW, input=[  # type: ignore[arg-type]
        {"role": "system", "content": "Be brief."}, _user("Tell me about cats.")])  # fmt: skip
    assert r1.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert r1.output_text == want.output_text
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [it.type for it in items] == ["message"] * 3
    assert items[2].id == r1.output[0].id and items[2].content[0].text == r1.output_text  # type: ignore[union-attr]

    with client.responses.stream(model=model, input="And dogs?", conversation=conv.id,
                                 **KW) as s:  # type: ignore[arg-type]  # fmt: skip
        r2 = s.get_final_response()
    r3 = twin.responses.create(model=model, input=[_user("Which is older?")],
                               conversation={"id": conv.id}, **KW)  # type: ignore[arg-type]  # fmt: skip
    items = client.conversations.items.list(conv.id, order="asc", limit=100).data
    history = _as_input(items[:5]) + [_user("Which is older?")]
    want = client.responses.create(model=model, input=history, store=False, **KW)  # type: ignore[arg-type]
    assert r3.usage.input_tokens == want.usage.input_tokens  # type: ignore[union-attr]
    assert r3.output_text == want.output_text
    assert [it.id for it in items[3:5]] == [items[3].id, r2.output[0].id]
    assert len(items) == 7 and items[6].id == r3.output[0].id
    # the turn's items joined once: GET of a stored response stores nothing again
    client.responses.retrieve(r3.id)
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 7
