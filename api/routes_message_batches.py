"""Anthropic's Message Batches API: ``/v1/messages/batches`` (create, retrieve, list,
cancel, results, delete), on the Batch API's runner.

A message batch is a batch of ``/v1/messages`` requests (:mod:`tasks.batches`): its
requests become the input file the runner reads (one line per request, its ``params`` the
body), its record and answers are the Batch API's, and ``conveyor batch-runner`` sends
them to the API below online traffic, exactly as for OpenAI's batches. This module only
speaks Anthropic's shapes: the ``message_batch`` object (``processing_status``
``in_progress`` / ``canceling`` / ``ended``, ``request_counts`` by outcome), and its
results, a JSONL line per request in the order sent: ``succeeded`` with the Message,
``errored`` with Anthropic's error, or ``canceled`` / ``expired`` for a request the batch
never sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.anthropic import MessagesRequest, cursor_page, page_body, rfc3339
from api.errors import OpenAIError, anthropic_error_body, bad_request
from api.routes_batches import (
    ask_cancel,
    batch_ids,
    batch_record,
    check_runner,
    file_store,
    queue_batch,
)
from api.state import api_state
from tasks.batches import (
    TERMINAL,
    batch_key,
    batches_key,
    lease_key,
    new_batch,
    parse_input,
    results_key,
)

router = APIRouter()

ENDPOINT = "/v1/messages"
PREFIX = "msgbatch_"
MAX_REQUESTS = 100_000  # Anthropic's limit per batch
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class BatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str
    params: dict


class MessageBatchRequest(BaseModel):
    requests: list[BatchItem] = Field(min_length=1, max_length=MAX_REQUESTS)


@router.post("/v1/messages/batches")
async def create_message_batch(body: MessageBatchRequest, request: Request) -> dict:
    """Check every request (a 400 naming the first bad one: nothing is queued), write them
    as the batch's input file, and queue the batch."""
    st = api_state(request)
    seen: set[str] = set()
    lines = []
    for i, item in enumerate(body.requests):
        if not CUSTOM_ID.fullmatch(item.custom_id):
            raise bad_request("custom_id must be 1 to 64 letters, digits, '_' or '-'",
                              f"requests.{i}.custom_id")  # fmt: skip
        if item.custom_id in seen:
            raise bad_request(f"custom_id {item.custom_id!r} is used twice",
                              f"requests.{i}.custom_id")  # fmt: skip
        seen.add(item.custom_id)
        _check_params(item.params, f"requests.{i}.params")
        lines.append(json.dumps({"custom_id": item.custom_id, "method": "POST",
                                 "url": ENDPOINT, "body": item.params}))  # fmt: skip
    await check_runner(st)
    data = ("\n".join(lines) + "\n").encode()
    batch = new_batch("", ENDPOINT, "24h", len(lines), None)
    batch["id"] = PREFIX + secrets.token_hex(12)
    meta = await asyncio.to_thread(file_store(request).put, data, f"{batch['id']}.jsonl", "batch")
    batch["input_file_id"] = meta["id"]
    await queue_batch(st, batch)
    return _message_batch(request, batch)


def _check_params(params: dict, param: str) -> None:
    """A request's params as ``/v1/messages`` takes them, not streamed."""
    try:
        req = MessagesRequest.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"{param}.{loc}: {err['msg']}", f"{param}.{loc}") from None
    if req.stream:
        raise bad_request("a batch's requests are not streamed", f"{param}.stream")


async def _get(request: Request, batch_id: str) -> dict:
    if not batch_id.startswith(PREFIX):
        raise OpenAIError(404, f"No message batch found with id '{batch_id}'.",
                          "invalid_request_error", "message_batch_id", "not_found")  # fmt: skip
    return await batch_record(request, batch_id)


@router.get("/v1/messages/batches/{batch_id}")
async def get_message_batch(request: Request, batch_id: str) -> dict:
    return _message_batch(request, await _get(request, batch_id))


@router.get("/v1/messages/batches")
async def list_message_batches(
    request: Request, limit: int = Query(20, ge=1, le=1000), after_id: str | None = None,
    before_id: str | None = None,
) -> dict:  # fmt: skip
    """The batches, newest first, a page after ``after_id`` or before ``before_id``."""
    ids = await batch_ids(api_state(request), PREFIX)
    chosen, has_more = cursor_page(ids, limit, after_id, before_id)
    page = []
    for batch_id in chosen:
        try:
            page.append(_message_batch(request, await batch_record(request, batch_id)))
        except OpenAIError:  # expired since it was listed
            continue
    return page_body(page, has_more)


@router.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_message_batch(request: Request, batch_id: str) -> dict:
    """Stop sending the batch's requests; those in flight end, the rest are ``canceled``."""
    st = api_state(request)
    batch = await _get(request, batch_id)
    if batch["status"] not in TERMINAL:
        await ask_cancel(st, batch_id)
    return _message_batch(request, await batch_record(request, batch_id))


@router.delete("/v1/messages/batches/{batch_id}")
async def delete_message_batch(request: Request, batch_id: str) -> dict:
    """Forget an ended batch (its record, answers and input); cancel a running one first."""
    st = api_state(request)
    batch = await _get(request, batch_id)
    if batch["status"] not in TERMINAL:
        raise bad_request("the batch is still processing: cancel it and wait for it to end "
                          "before deleting it", "message_batch_id")  # fmt: skip
    pipe = st.redis.pipeline(transaction=False)
    for key in (batch_key(batch_id), results_key(batch_id, "out"),
                results_key(batch_id, "err"), lease_key(batch_id)):  # fmt: skip
        pipe.delete(key)
    pipe.zrem(batches_key(), batch_id)
    await pipe.execute()
    await asyncio.to_thread(file_store(request).delete, batch["input_file_id"])
    return {"id": batch_id, "type": "message_batch_deleted"}


@router.get("/v1/messages/batches/{batch_id}/results")
async def message_batch_results(request: Request, batch_id: str) -> Response:
    """A line per request, in the order they were sent, once the batch has ended."""
    st = api_state(request)
    batch = await _get(request, batch_id)
    if batch["status"] not in TERMINAL:
        raise bad_request("the batch is still processing: its results come once it has ended",
                          "message_batch_id")  # fmt: skip
    data = await asyncio.to_thread(file_store(request).read, batch["input_file_id"])
    lines = parse_input(data or b"", ENDPOINT)
    pipe = st.redis.pipeline(transaction=False)
    pipe.hgetall(results_key(batch_id, "out"))
    pipe.hgetall(results_key(batch_id, "err"))
    outs, errs = ({_s(k): json.loads(v) for k, v in h.items()} for h in await pipe.execute())
    unsent = "expired" if batch["status"] == "expired" else "canceled"
    out = []
    for line in lines:
        cid = line["custom_id"]
        if cid in outs:
            result = {"type": "succeeded", "message": outs[cid]["response"]["body"]}
        elif cid in errs:
            result = {"type": "errored", "error": _error(errs[cid])}
        else:
            result = {"type": unsent}
        out.append(json.dumps({"custom_id": cid, "result": result}) + "\n")
    return Response("".join(out).encode(), media_type="application/binary")


def _error(line: dict) -> dict:
    """A failed request's error, in Anthropic's shape (the API's answer, or why there was
    none)."""
    body = (line.get("response") or {}).get("body")
    if isinstance(body, dict) and body.get("type") == "error":
        return body
    status = (line.get("response") or {}).get("status_code") or 500
    return anthropic_error_body(status, (line.get("error") or {}).get("message") or "failed")


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _message_batch(request: Request, b: dict) -> dict:
    """The Batch API's record as Anthropic's ``message_batch`` object."""
    status, counts = b["status"], b["request_counts"]
    ended = status in TERMINAL
    left = counts["total"] - counts["completed"] - counts["failed"]
    results = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{b['id']}/results"
    return {
        "id": b["id"],
        "type": "message_batch",
        "processing_status": "ended" if ended else
        ("canceling" if status == "cancelling" else "in_progress"),
        "request_counts": {
            "processing": 0 if ended else left,
            "succeeded": counts["completed"],
            "errored": counts["failed"],
            "canceled": left if status == "cancelled" else 0,
            "expired": left if status == "expired" else 0,
        },
        "ended_at": rfc3339(b.get(f"{status}_at")) if ended else None,
        "created_at": rfc3339(b["created_at"]),
        "expires_at": rfc3339(b["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": rfc3339(b.get("cancelling_at") or b.get("cancelled_at")),
        "results_url": results if ended else None,
    }  # fmt: skip
