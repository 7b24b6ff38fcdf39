"""OpenAI's Files and Batch APIs: ``/v1/files`` (upload a JSONL input, read an output) and
``/v1/batches`` (create, retrieve, list, cancel).

Files live in ``CONVEYOR_FILES_DIR`` (:class:`tasks.files.DirFileStore`); a batch's record
and answers in Redis, and its job is a Celery task on the ``batch`` queue, which
``conveyor batch-runner`` runs below online traffic (:mod:`tasks.batches`). Any API
replica answers for any batch.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from api.errors import OpenAIError, bad_request
from api.state import ApiState, api_state
from tasks.batches import (
    ENDPOINTS,
    QUEUED_S,
    WINDOWS,
    InvalidInput,
    batch_key,
    batches_key,
    lease_key,
    new_batch,
    parse_input,
    results_key,
    runners_key,
    send,
    with_counts,
)
from tasks.batches import RECORD_TTL_S as BATCH_TTL_S
from tasks.files import PURPOSES, DirFileStore

router = APIRouter()


def file_store(request: Request) -> DirFileStore:
    return DirFileStore(api_state(request).settings.batch.files_dir)


def _not_found(what: str, ident: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"No {what} found with id '{ident}'.", "invalid_request_error",
                       param, "not_found")  # fmt: skip


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload_file(request: Request, file: UploadFile, purpose: str = Form(...)) -> dict:
    if purpose not in PURPOSES:
        raise bad_request(f"purpose {purpose!r} is not one of {', '.join(PURPOSES)}", "purpose")
    data = await file.read()
    name = file.filename or "upload"
    return await asyncio.to_thread(file_store(request).put, data, name, purpose)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> dict:
    files = await asyncio.to_thread(file_store(request).list, purpose)
    return {"object": "list", "data": files, "has_more": False}


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict:
    meta = await asyncio.to_thread(file_store(request).meta, file_id)
    if meta is None:
        raise _not_found("file", file_id, "file_id")
    return meta


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    data = await asyncio.to_thread(file_store(request).read, file_id)
    if data is None:
        raise _not_found("file", file_id, "file_id")
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict:
    if not await asyncio.to_thread(file_store(request).delete, file_id):
        raise _not_found("file", file_id, "file_id")
    return {"id": file_id, "object": "file", "deleted": True}


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------
class BatchRequest(BaseModel):
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create_batch(body: BatchRequest, request: Request) -> dict:
    st = api_state(request)
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint {body.endpoint!r} is not one of {', '.join(ENDPOINTS)}",
                          "endpoint")  # fmt: skip
    if body.completion_window not in WINDOWS:
        raise bad_request(f"completion_window must be one of {', '.join(WINDOWS)}",
                          "completion_window")  # fmt: skip
    store = file_store(request)
    data = await asyncio.to_thread(store.read, body.input_file_id)
    if data is None:
        raise _not_found("file", body.input_file_id, "input_file_id")
    try:
        lines = parse_input(data, body.endpoint)
    except InvalidInput as e:
        raise bad_request(f"input file {body.input_file_id}: {e}", "input_file_id",
                          "invalid_input_file") from None  # fmt: skip
    await check_runner(st)
    batch = new_batch(body.input_file_id, body.endpoint, body.completion_window, len(lines),
                      body.metadata)  # fmt: skip
    await queue_batch(st, batch)
    return batch


async def check_runner(st: ApiState) -> None:
    """A 503 unless a batch runner is live to take a new batch."""
    now_ms = int(time.time() * 1000)
    if not await st.redis.zcount(runners_key(), now_ms, "+inf"):
        raise OpenAIError(503, "no batch runner is running: start `conveyor batch-runner` "
                          "(conveyor serve starts one; compose: --profile batch)",
                          "server_error", None, "no_batch_runner")  # fmt: skip


async def queue_batch(st: ApiState, batch: dict) -> None:
    """Record a new batch and queue its task for a runner."""
    pipe = st.redis.pipeline(transaction=False)
    pipe.hset(batch_key(batch["id"]), "b", json.dumps(batch))
    pipe.expire(batch_key(batch["id"]), BATCH_TTL_S)
    pipe.zadd(batches_key(), {batch["id"]: batch["created_at"]})
    pipe.set(lease_key(batch["id"]), "queued", px=int(QUEUED_S * 1000))
    await pipe.execute()
    await asyncio.to_thread(send, batch["id"])


async def batch_record(request: Request, batch_id: str) -> dict:
    """The Batch object: its record, its live counts, ``cancelling`` once a cancel was asked
    for and until its runner has stopped."""
    st = api_state(request)
    pipe = st.redis.pipeline(transaction=False)
    pipe.hmget(batch_key(batch_id), "b", "cancel")
    pipe.hlen(results_key(batch_id, "out"))
    pipe.hlen(results_key(batch_id, "err"))
    (raw, cancel), done, failed = await pipe.execute()
    if raw is None:
        raise _not_found("batch", batch_id, "batch_id")
    batch = json.loads(raw)
    if cancel is not None and batch["status"] == "in_progress":
        batch.update(status="cancelling", cancelling_at=int(cancel))
    return with_counts(batch, done, failed)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict:
    return await batch_record(request, batch_id)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
    st = api_state(request)
    limit = max(1, min(limit, 100))
    ids = await batch_ids(st, "batch_")
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1 :]
    data = []
    for batch_id in ids[: limit + 1]:
        try:
            data.append(await batch_record(request, batch_id))
        except OpenAIError:  # expired
            await st.redis.zrem(batches_key(), batch_id)
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}  # fmt: skip


async def batch_ids(st: ApiState, prefix: str) -> list[str]:
    """The batches' ids, newest first: OpenAI's (``batch_``) or Anthropic's
    (``msgbatch_``), which share the runner and its records."""
    raw = await st.redis.zrevrange(batches_key(), 0, -1)
    ids = [i.decode() if isinstance(i, bytes) else str(i) for i in raw]
    return [i for i in ids if i.startswith(prefix)]


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    """Stop a batch: its runner sends no more of its requests, lets those in flight end and
    writes what was answered (status ``cancelling``, then ``cancelled``)."""
    st = api_state(request)
    await batch_record(request, batch_id)  # a 404 for an unknown one
    await ask_cancel(st, batch_id)
    return JSONResponse(await batch_record(request, batch_id))


async def ask_cancel(st: ApiState, batch_id: str) -> None:
    """Ask the batch's runner to stop (the first ask's time is kept): it sends no more of
    its requests, lets those in flight end and writes what was answered."""
    await st.redis.hsetnx(batch_key(batch_id), "cancel", int(time.time()))
