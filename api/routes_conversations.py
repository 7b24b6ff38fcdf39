"""OpenAI's Conversations API: ``/v1/conversations`` and their items, kept in Redis
(:mod:`cluster.conversations`) so every API replica answers for them.

A conversation holds items in the Responses API's input shapes (messages, function calls
and their outputs, reasoning items). A ``POST /v1/responses`` with ``conversation`` renders
the conversation's items before its ``input``; once the response ends (completed or
incomplete) its input and output items are added to the conversation
(:mod:`api.routes_responses`). Items are checked as a Responses input item is when they
are added, so a conversation always renders.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.errors import OpenAIError, bad_request
from api.responses import created_now, stored_item
from api.state import ApiState, api_state
from cluster.conversations import Conversation

router = APIRouter()

MAX_ITEMS = 20  # items per create or add request (OpenAI's limit)
MAX_METADATA = 16  # metadata pairs (OpenAI's limits: keys to 64 characters, values to 512)


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="ignore")

    items: list[Any] | None = None
    metadata: dict[str, Any] | None = None


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="ignore")

    metadata: dict[str, Any]


class AddItems(BaseModel):
    model_config = ConfigDict(extra="ignore")

    items: list[Any] = Field(min_length=1)


def _store(request: Request) -> ApiState:
    st = api_state(request)
    if not st.settings.api.responses_store:
        raise bad_request("the Conversations API needs the response store "
                          "(CONVEYOR_RESPONSES_STORE is off)", None,
                          "unsupported_parameter")  # fmt: skip
    return st


def _metadata(metadata: dict[str, Any] | None) -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 pairs, string keys to 64 characters and string
    values to 512."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata holds at most {MAX_METADATA} pairs", "metadata")
    for k, v in metadata.items():
        if len(k) > 64:
            raise bad_request(f"metadata key {k[:16]!r}... is longer than 64 characters",
                              "metadata")  # fmt: skip
        if not isinstance(v, str) or len(v) > 512:
            raise bad_request(f"metadata value of {k!r} must be a string of at most 512 "
                              "characters", "metadata")  # fmt: skip
    return metadata


def _items(items: list[Any], param: str) -> list[dict]:
    if len(items) > MAX_ITEMS:
        raise bad_request(f"at most {MAX_ITEMS} items per request, got {len(items)}", param)
    return [stored_item(item, f"{param}.{i}") for i, item in enumerate(items)]


def _not_found(conversation_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Conversation with id '{conversation_id}' not found.",
                       "invalid_request_error", param, "not_found")  # fmt: skip


def _item_not_found(item_id: str) -> OpenAIError:
    return OpenAIError(404, f"Item with id '{item_id}' not found.", "invalid_request_error",
                       "item_id", "not_found")  # fmt: skip


async def conversation_of(st: ApiState, conversation_id: str, param: str | None = None,
                          items: bool = True) -> Conversation:  # fmt: skip
    """The conversation, with its items unless ``items`` is false; 404 (naming ``param``)
    if there is none."""
    conv = await st.conversations.get(conversation_id, items)
    if conv is None:
        raise _not_found(conversation_id, param)
    return conv


def page(items: list[dict], order: str, after: str | None, limit: int, where: str) -> dict:
    """A list of items as OpenAI pages them: ``order`` asc or desc, ``limit`` 1-100,
    ``after`` an item id."""
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    items = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise bad_request(f"no item {after!r} in {where}", "after")
        items = items[at + 1 :]
    return listing(items[:limit], len(items) > limit)


def listing(data: list[dict], has_more: bool = False) -> dict:
    """OpenAI's list object of items."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}  # fmt: skip


@router.post("/v1/conversations")
async def create_conversation(body: CreateConversation, request: Request) -> JSONResponse:
    st = _store(request)
    metadata = _metadata(body.metadata)
    items = _items(body.items or [], "items")
    cid = "conv_" + secrets.token_hex(24)
    created = created_now()
    await st.conversations.create(cid, created, metadata, items)
    return JSONResponse(Conversation(cid, created, metadata, items).body())


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> JSONResponse:
    conv = await conversation_of(_store(request), conversation_id, items=False)
    return JSONResponse(conv.body())


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: UpdateConversation,
                              request: Request) -> JSONResponse:  # fmt: skip
    """Replace the conversation's metadata (OpenAI's update: metadata only)."""
    st = _store(request)
    metadata = _metadata(body.metadata)
    if not await st.conversations.set_metadata(conversation_id, metadata):
        raise _not_found(conversation_id)
    return JSONResponse((await conversation_of(st, conversation_id, items=False)).body())


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> JSONResponse:
    st = _store(request)
    if not await st.conversations.delete(conversation_id):
        raise _not_found(conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted",
                         "deleted": True})  # fmt: skip


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request, after: str | None = None,
                     limit: int = 20, order: str = "desc") -> JSONResponse:  # fmt: skip
    """The conversation's items, newest first unless ``order=asc``. ``include`` is
    accepted and adds nothing (no item here carries more than it shows)."""
    conv = await conversation_of(_store(request), conversation_id)
    return JSONResponse(page(conv.items, order, after, limit,
                              f"conversation '{conversation_id}'"))  # fmt: skip


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: AddItems, request: Request) -> JSONResponse:
    """Append items (at most 20); the items added, in order. An item whose id the
    conversation holds already is not added again."""
    st = _store(request)
    items = _items(body.items, "items")
    added = await st.conversations.add(conversation_id, items)
    if added is None:
        raise _not_found(conversation_id)
    new = set(added)
    data = [it for it in items if it["id"] in new]
    return JSONResponse(listing(data))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    conv = await conversation_of(_store(request), conversation_id)
    item = next((it for it in conv.items if it.get("id") == item_id), None)
    if item is None:
        raise _item_not_found(item_id)
    return JSONResponse(item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    """Remove an item; the Conversation (OpenAI's answer)."""
    st = _store(request)
    removed = await st.conversations.remove(conversation_id, item_id)
    if removed is None:
        raise _not_found(conversation_id)
    if not removed:
        raise _item_not_found(item_id)
    return JSONResponse((await conversation_of(st, conversation_id, items=False)).body())
