"""vLLM's serving-platform endpoints: ``/ping`` and ``/invocations`` (the two routes
Amazon SageMaker and similar hosts call: a health check, and one URL for every kind of
request) and ``GET /version``.

``/invocations`` reads the body's shape, as vLLM does, and answers as the endpoint that
takes that shape would: ``messages`` is a chat completion, ``prompt`` a completion,
``input`` an embedding (on a sequence classifier: a classification), ``query`` and
``documents`` a rerank, a pair of score fields
(``queries`` / ``items``, ``text_1`` / ``text_2``, ...) a score. Streaming, errors and
headers are that endpoint's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from api import routes_classify, routes_embeddings, routes_openai, routes_ops, routes_scores
from api.errors import bad_request
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.state import api_state

router = APIRouter()

M = TypeVar("M", bound=BaseModel)
Endpoint = Callable[[Any, Request], Awaitable[Response]]

# (the field that tells the shape, the request model, the endpoint), tried in this order
SHAPES: tuple[tuple[str, type[BaseModel], Endpoint], ...] = (
    ("messages", ChatCompletionRequest, routes_openai.chat_completions),
    ("prompt", CompletionRequest, routes_openai.completions),
    ("input", routes_embeddings.EmbeddingRequest, routes_embeddings.embeddings),
    ("documents", routes_scores.RerankRequest, routes_scores.rerank),
)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> JSONResponse:
    """``/health``'s answer: 200 when Redis answers and every required pool has a worker."""
    return await routes_ops.health(request)


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the body is not JSON", None) from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    for field, model, endpoint in SHAPES:
        if field in body and not (field == "documents" and "query" not in body):
            if field == "input" and api_state(request).classifier is not None:
                # a sequence classifier's inputs are classified (as vLLM routes them)
                model, endpoint = routes_classify.ClassificationRequest, routes_classify.classify
            return await endpoint(_parsed(model, body), request)
    if any(a in body and b in body for a, b in routes_scores.PAIRS):
        return await routes_scores.score(_parsed(routes_scores.ScoreRequest, body), request)
    raise bad_request(
        "the body's shape names no endpoint: send messages (chat), prompt (completions), "
        "input (embeddings), query and documents (rerank), or a pair of texts to score",
        None,
    )


def _parsed(model: type[M], body: dict) -> M:
    """``body`` as ``model``; a bad field is the 400 the endpoint itself would give."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors()]) from None  # fmt: skip


@router.get("/version")
async def server_version() -> JSONResponse:
    try:
        v = version("conveyor")
    except PackageNotFoundError:  # run from a tree that was never installed
        v = "unknown"
    return JSONResponse({"version": v})
