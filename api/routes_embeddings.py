"""``POST /v1/embeddings``: OpenAI's embeddings, with vLLM's extensions.

The request's inputs (a string, a list of strings, a list of token ids, a list of such
lists, or vLLM's chat ``messages``) are tokenized, truncated if asked
(``truncate_prompt_tokens``) and checked against the context window here; each input
then runs through the pipeline as a request of its own (:meth:`api.runner.Runner.start`
with :class:`kvbm.protocol.Pooling`: one ``embed`` task on a worker the router picks, the
same admission as every request), at most ``PARALLEL_INPUTS`` of one request at a time.
Its stream's one frame carries the pooled, normalised vector as base64 of little-endian
float32 (what OpenAI's ``encoding_format: "base64"`` is, so it goes out as it came); the
worker side is :mod:`workers.pooling`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import time
from pathlib import Path
from typing import Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from api.admission import client_id
from api.classifier import Classifier
from api.errors import OpenAIError, bad_request, first_error
from api.protocol import PIN_HEADER, ChatMessage
from api.state import ApiState, api_state, check_model
from api.tokenization import PromptBuilder
from kvbm.protocol import Pooling, Sampling

router = APIRouter()

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
# inputs of one request in flight at once: a large batch queues behind its own first
# inputs instead of taking every worker's admission slots at once
PARALLEL_INPUTS = 16
_UNUSED_SAMPLING = Sampling(max_tokens=1)  # the payload's sampling: nothing is sampled


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, then vLLM's extensions (their names and defaults)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[int] | list[list[int]] | list[str] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: the chat form of the input (EmbeddingChatRequest), and its options
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: True for input, False for messages
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    use_activation: bool | None = None  # normalise (None: as the model's pooling says)
    normalize: bool | None = None  # vLLM's older name, which it now refuses
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"  # every host we run is little-endian
    # Conveyor's: run on exactly this worker (as the other endpoints' worker_id)
    worker_id: str | None = Field(None, min_length=1, max_length=200)


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling`` body: an embeddings body, and the pooling ``task``."""

    task: str | None = None  # None or "embed": what the served model pools (its embedding)


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request) -> Response:
    return await _pooled(req, request, "embd", "embedding", "embedding", {}, "embed")


@router.post("/pooling")
async def pooling(req: PoolingRequest, request: Request) -> Response:
    """vLLM's ``/pooling``: the model's pooled output per input (``data``): an embedding
    model's embedding, as ``/v1/embeddings`` computes it (task ``embed``), a sequence
    classifier's class probabilities, as ``/classify`` computes them (task ``classify``).
    Without a ``task``, the one the model serves."""
    st = api_state(request)
    default = "embed" if st.classifier is None else "classify"
    task = req.task or default
    if task != default:
        raise bad_request(f"task {req.task!r} is not served: the model pools for task "
                          f"{default!r}", "task", "unsupported_parameter")  # fmt: skip
    return await _pooled(req, request, "pool", "pooling", "data", {"completion_tokens": 0},
                         task)  # fmt: skip


async def _pooled(req: EmbeddingRequest, request: Request, prefix: str, obj: str, field: str,
                  usage: dict[str, int], task: str) -> Response:  # fmt: skip
    """Pool a request's inputs and answer the list of them: each item an ``obj`` with its
    vector under ``field`` (float32 values, or base64 as the worker sent it): for task
    ``embed`` an embedding, for ``classify`` a sequence classifier's class probabilities
    (api.classifier)."""
    started = time.perf_counter()
    st = api_state(request)
    await check_model(st, req.model, adapters=False, task=task)
    c = st.classifier if task == "classify" else None
    if c is None:
        pooling = pooling_of(req, str(st.settings.model), st.settings.model_name)
    else:
        pooling = Pooling(task="classify")
    inputs = embedding_inputs(req, st.builder)
    rid, vectors = await embed(st, request, inputs, pooling, started, req.worker_id, prefix)
    n_tokens = sum(len(ids) for ids in inputs)
    b64 = req.encoding_format == "base64"
    if c is None:  # the embedding as the worker sent it, or its float32 values
        values: list[str | np.ndarray] = [v if b64 else vector(v) for v in vectors]
    else:  # the class probabilities, in the same two forms
        values = [_b64(p) if b64 else p for p in class_probs(c, vectors, req.use_activation)]
    data = [{"object": obj, "index": i, field: v} for i, v in enumerate(values)]
    body = {"id": rid, "object": "list", "created": int(time.time()),
            "model": st.settings.model_name, "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, **usage}}  # fmt: skip
    # float32 values written as float32 (the shortest text that reads back the same)
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json", headers={"x-request-id": rid})  # fmt: skip


async def embed(
    st: ApiState, request: Request, inputs: list[list[int]], pooling: Pooling, started: float,
    worker_id: str | None, prefix: str,
) -> tuple[str, list[str]]:  # fmt: skip
    """Pool token lists as one client request (its tenant's budget, the API's metrics):
    its id (``prefix``-...) and each input's vector (base64 float32: an embedding, or a
    classifier's logits), in input order."""
    pin = worker_id or request.headers.get(PIN_HEADER) or None
    n_tokens = sum(len(ids) for ids in inputs)
    tenant = client_id(request.scope, bool(st.settings.api.api_key_list))
    await st.tenants.admit(tenant, n_tokens)  # 429 when its minute is spent
    rid = st.hub.new_request_id(prefix)
    m = st.metrics
    m.in_flight.inc()
    try:
        vectors = await _embed_all(st, rid, inputs, pooling, started, pin)
    finally:
        m.in_flight.dec()
        m.e2e.observe(time.perf_counter() - started)
    m.prompt_tokens.inc(n_tokens)
    if pooling.task == "classify":
        m.classification_inputs.inc(len(inputs))
    else:
        m.embedding_inputs.inc(len(inputs))
        m.embedding_tokens.inc(n_tokens)
    return rid, vectors


def vector(b64: str) -> np.ndarray:
    """An embedding as the worker sent it (base64 of little-endian float32)."""
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def class_probs(c: Classifier, logits: list[str], use_activation: bool | None) -> list[np.ndarray]:
    """Each input's class probabilities (float32) from the logits the worker sent: the
    classifier's activation, or none with ``use_activation`` False."""
    return [c.activate(vector(v), use_activation).astype(np.float32) for v in logits]


def _b64(values: np.ndarray) -> str:
    """``values`` as the worker sends a vector (base64 of little-endian float32)."""
    return base64.b64encode(values.astype("<f4").tobytes()).decode()


# --------------------------------------------------------------------------------------
def pooling_of(req: EmbeddingRequest, model_dir: str, name: str) -> Pooling:
    """The request's pooling parameters; ``dimensions`` only for a matryoshka model, as
    vLLM allows it (``is_matryoshka`` or ``matryoshka_dimensions`` in its config.json)."""
    if req.normalize is not None:
        raise bad_request("Parameter `normalize` was removed; use `use_activation` instead "
                          "(as vLLM)", "normalize", "invalid_value")  # fmt: skip
    d = req.dimensions
    if d is not None:
        matryoshka, allowed, hidden = model_dimensions(model_dir)
        if not matryoshka:
            raise bad_request(
                f'Model "{name}" does not support matryoshka representation, changing '
                "output dimensions will lead to poor results.",
                "dimensions",
                "invalid_value",
            )
        if d < 1 or d > hidden:
            raise bad_request(f"dimensions must be in [1, {hidden}] (the model's hidden "
                              f"size), got {d}", "dimensions", "invalid_value")  # fmt: skip
        if allowed and d not in allowed:
            raise bad_request(
                f'Model "{name}" only supports {allowed} matryoshka dimensions, use other '
                "output dimensions will lead to poor results.",
                "dimensions",
                "invalid_value",
            )
    return Pooling(dimensions=d, normalize=req.use_activation)


@functools.cache
def model_dimensions(model_dir: str) -> tuple[bool, list[int] | None, int]:
    """(matryoshka, its allowed dimensions or None for any, hidden size) of a checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    allowed = cfg.get("matryoshka_dimensions")
    matryoshka = bool(cfg.get("is_matryoshka")) or bool(allowed)
    hidden = int(cfg.get("text_config", cfg)["hidden_size"])
    return matryoshka, [int(x) for x in allowed] if allowed else None, hidden


def embedding_inputs(req: EmbeddingRequest, builder: PromptBuilder) -> list[list[int]]:
    """Each input's token ids: tokenized, truncated if asked, checked (a 400 names what
    is wrong: an empty input, an id out of the vocabulary, one too long)."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("give exactly one of input and messages", "input", "invalid_value")
    param = "input" if req.input is not None else "messages"
    if req.messages is not None:
        prompt = builder.chat_prompt(
            req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens),
        )  # fmt: skip
        if prompt.images:
            raise bad_request("images cannot be embedded: send text content parts", "messages",
                              "unsupported_content")  # fmt: skip
        seqs = [prompt.token_ids]
    else:
        inp = req.input
        assert inp is not None
        items: list[str | list[int]]
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            items = [inp]  # one input: a string or token ids
        else:
            items = list(inp)  # type: ignore[arg-type]  # several: strings or id lists
        if not items:
            raise bad_request("input must not be empty", "input", "invalid_value")
        if len(items) > MAX_INPUTS:
            raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(items)}",
                              "input", "invalid_value")  # fmt: skip
        special = True if req.add_special_tokens is None else req.add_special_tokens
        tok, vocab = builder.tokenizer, builder.vocab_size
        seqs = []
        for item in items:
            if isinstance(item, str):
                seqs.append(tok.encode(item, add_special_tokens=special).ids)
                continue
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", "input",
                                  "invalid_value")  # fmt: skip
            seqs.append(list(item))
    seqs = [_truncate(ids, req, builder) for ids in seqs]
    limit = builder.max_model_len
    for i, ids in enumerate(seqs):
        which = f"input {i}" if len(seqs) > 1 else "the input"
        if not ids:
            raise bad_request(f"{which} has no tokens", param, "invalid_value")
        if len(ids) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, {which} "
                f"has {len(ids)} tokens. Please reduce the length of the input, or set "
                "truncate_prompt_tokens.",
                param,
                "context_length_exceeded",
            )
    return seqs


def _truncate(ids: list[int], req: EmbeddingRequest, builder: PromptBuilder) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep that many tokens (-1: the context window),
    the first ones (``truncation_side`` right, the tokenizer's default) or the last."""
    keep = builder.truncation_keep(req.truncate_prompt_tokens)
    if keep is None or len(ids) <= keep:
        return ids
    side = req.truncation_side or builder.truncation_side
    return ids[-keep:] if side == "left" else ids[:keep]


async def _embed_all(st: ApiState, rid: str, inputs: list[list[int]], pooling: Pooling,
                     started: float, pin: str | None) -> list[str]:  # fmt: skip
    """Each input's vector (base64), in input order: one pipeline request per input
    (``<rid>.<i>``), ``PARALLEL_INPUTS`` at a time. The first failure cancels the rest
    (their workers drop them) and is the request's answer."""
    runner = st.runner
    assert runner is not None, "the API's runner is started by its lifespan"
    gate = asyncio.Semaphore(PARALLEL_INPUTS)
    out: list[str] = [""] * len(inputs)

    async def one(i: int, ids: list[int]) -> None:
        async with gate:
            (run,) = await runner.start(f"{rid}.{i}", ids, _UNUSED_SAMPLING, started, pin,
                                        pooling=pooling)  # fmt: skip
            try:
                frame = run.first_frame
                assert frame is not None and frame.done, "an embedding's one frame is its last"
                if frame.embedding is None:
                    raise OpenAIError(500, "the worker sent no embedding", "server_error",
                                      None, "engine_error")  # fmt: skip
                out[i] = frame.embedding
            finally:
                runner.finish(run)

    try:
        async with asyncio.TaskGroup() as tg:
            for i, ids in enumerate(inputs):
                tg.create_task(one(i, ids))
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None
    return out
