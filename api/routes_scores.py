"""vLLM's scoring endpoints on an embedding model: ``/score`` (``/v1/score``) and the
Jina / Cohere style ``/rerank`` (``/v1/rerank``, ``/v2/rerank``).

As vLLM scores with a model that embeds (its bi-encoder path), each text is embedded
through the pipeline exactly as ``/v1/embeddings`` embeds it (:func:`api.routes_embeddings
.embed`: one request per text, the same routing, admission and tenant budget), and a
pair's score is the cosine similarity of its two vectors. Pairs are 1:1, 1:N (the one
query against every document) or N:N, as in vLLM. On a cross-encoder (a sequence
classifier with one label: :mod:`api.classifier`) each pair is one input instead, the
query and the document joined as the tokenizer's text pair, and its score the head's
output (vLLM's cross-encoder path). Text inputs only.
"""

from __future__ import annotations

import time

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from api.errors import bad_request
from api.routes_embeddings import EmbeddingRequest, embed, embedding_inputs, vector
from api.state import ApiState, api_state, check_model
from kvbm.protocol import Pooling

router = APIRouter()

# the field pairs vLLM's score request takes (the first given is used)
PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
         ("text_1", "text_2"))  # fmt: skip


class _Scoring(BaseModel):
    """What both endpoints take (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # the served model when left out, as in vLLM
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    max_tokens_per_query: int = Field(0, ge=0)  # 0: no query-level truncation
    max_tokens_per_doc: int = Field(0, ge=0)
    use_activation: bool | None = None  # a cross-encoder's: False keeps its raw logit
    worker_id: str | None = Field(None, min_length=1, max_length=200)


class ScoreRequest(_Scoring):
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None


class RerankRequest(_Scoring):
    query: str
    documents: str | list[str]
    top_n: int = Field(0, ge=0)  # 0: every document


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    first, second = _pair_fields(body)
    queries, docs = _texts(getattr(body, first), first), _texts(getattr(body, second), second)
    if len(queries) > 1 and len(queries) != len(docs):
        raise bad_request(f"Input lengths must be either 1:1, 1:N or N:N (got {len(queries)} "
                          f"{first} and {len(docs)} {second})", second)  # fmt: skip
    rid, scores, n_tokens = await _scores(st, request, body, queries, docs, started, "score")
    return JSONResponse({
        "id": rid, "object": "list", "created": int(time.time()),
        "model": st.settings.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0},
    })  # fmt: skip


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    docs = _texts(body.documents, "documents")
    rid, scores, n_tokens = await _scores(st, request, body, [body.query], docs, started,
                                          "rerank")  # fmt: skip
    order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    return JSONResponse({
        "id": rid, "model": st.settings.model_name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": [{"index": i, "document": {"text": docs[i], "multi_modal": None},
                     "relevance_score": scores[i]} for i in order],
    })  # fmt: skip


# --------------------------------------------------------------------------------------
def _pair_fields(body: ScoreRequest) -> tuple[str, str]:
    for a, b in PAIRS:
        if getattr(body, a) is not None and getattr(body, b) is not None:
            return a, b
    raise bad_request("give the texts to score: queries and documents (or items), "
                      "data_1 and data_2, or text_1 and text_2", "queries")  # fmt: skip


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise bad_request(f"{param} must not be empty", param)
    return texts


async def _scores(st: ApiState, request: Request, body: _Scoring, queries: list[str],
                  docs: list[str], started: float,
                  prefix: str) -> tuple[str, list[float], int]:  # fmt: skip
    """Embed the queries and the documents (tokenized, checked and truncated as
    ``/v1/embeddings`` does, then cut to ``max_tokens_per_query`` / ``_doc``) and score
    each pair: the request id, the scores in pair order and the prompt tokens."""
    if body.model is not None:
        await check_model(st, body.model, adapters=False)

    def ids(texts: list[str], cap: int) -> list[list[int]]:
        req = EmbeddingRequest(model=st.settings.model_name, input=texts,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)  # fmt: skip
        seqs = embedding_inputs(req, st.builder)
        return [s[:cap] for s in seqs] if cap else seqs

    if st.classifier is not None:
        return await _cross_scores(st, request, body, queries, docs, started, prefix)
    q_ids, d_ids = ids(queries, body.max_tokens_per_query), ids(docs, body.max_tokens_per_doc)
    inputs = q_ids + d_ids
    rid, vectors = await embed(st, request, inputs, Pooling(), started, body.worker_id, prefix)
    q = [vector(v) for v in vectors[: len(q_ids)]]
    d = [vector(v) for v in vectors[len(q_ids) :]]
    if len(q) == 1:
        q = q * len(d)
    scores = [_cosine(a, b) for a, b in zip(q, d, strict=True)]
    return rid, scores, sum(len(s) for s in inputs)


async def _cross_scores(st: ApiState, request: Request, body: _Scoring, queries: list[str],
                        docs: list[str], started: float,
                        prefix: str) -> tuple[str, list[float], int]:  # fmt: skip
    """A cross-encoder's scores (a sequence classifier with one label): each pair runs
    through the model as one input, the query and the document cut to
    ``max_tokens_per_query`` / ``_doc`` tokens first, joined as the tokenizer's text pair
    (or concatenated, for a model whose config says ``use_sep_token: false``), then
    truncated and checked as an embedding input; the score is the head's one output
    through the model's activation (api.classifier)."""
    c = st.classifier
    assert c is not None
    if c.num_labels != 1:
        raise bad_request(f"`{st.settings.model_name}` classifies into {c.num_labels} labels; "
                          "scoring needs a cross-encoder (one label)", "model",
                          "unsupported_model")  # fmt: skip
    tok = st.builder.tokenizer
    qs = [_cut(tok, q, body.max_tokens_per_query) for q in queries]
    ds = [_cut(tok, d, body.max_tokens_per_doc) for d in docs]
    if len(qs) == 1:
        qs = qs * len(ds)
    pairs = [tok.encode(q, d).ids if c.sep_pair else tok.encode(q + d).ids
             for q, d in zip(qs, ds, strict=True)]  # fmt: skip
    req = EmbeddingRequest(model=st.settings.model_name, input=pairs,
                           truncate_prompt_tokens=body.truncate_prompt_tokens)  # fmt: skip
    inputs = embedding_inputs(req, st.builder)
    rid, logits = await embed(st, request, inputs, Pooling(task="classify"), started,
                              body.worker_id, prefix)  # fmt: skip
    scores = [float(c.activate(vector(v), body.use_activation)[0]) for v in logits]
    return rid, scores, sum(len(s) for s in inputs)


def _cut(tok: Tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut where its first ``max_tokens`` tokens end (0: whole), as vLLM cuts a
    cross-encoder's query and document before joining them (at a character boundary, so
    the pair tokenizes as the text would)."""
    while max_tokens:
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            break
        end = min(enc.offsets[max_tokens - 1][1], enc.offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]
    return text


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity, as torch's ``cosine_similarity`` (its 1e-8 floor on the norms)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norm = max(float(np.linalg.norm(a64)), 1e-8) * max(float(np.linalg.norm(b64)), 1e-8)
    return float(np.dot(a64, b64) / norm)
