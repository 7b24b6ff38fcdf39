"""vLLM's ``/classify`` (and ``/v1/classify``): a sequence classifier's class probabilities
for each input.

The inputs are those of ``/v1/embeddings`` (a string, strings, token ids, lists of them, or
chat ``messages``; tokenized, truncated and checked by
:func:`api.routes_embeddings.embedding_inputs`), and each runs through the pipeline as
an embedding does (:func:`api.routes_embeddings.embed`), with
:class:`kvbm.protocol.Pooling` ``task`` classify: the worker returns the head's logits
for the input's last token, and the model's activation is applied here
(:mod:`api.classifier`). Only a ``*ForSequenceClassification`` checkpoint classifies;
any other model answers a 400.
"""

from __future__ import annotations

import time

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.routes_embeddings import EmbeddingRequest, class_probs, embed, embedding_inputs
from api.state import api_state, check_model
from kvbm.protocol import Pooling

router = APIRouter()


class ClassificationRequest(EmbeddingRequest):
    """vLLM's classification body: an embeddings body's inputs and options (its
    ``dimensions`` and ``encoding_format`` are not read), ``model`` optional."""

    model: str | None = None  # type: ignore[assignment]  # the served model when left out


@router.post("/classify")
@router.post("/v1/classify")
async def classify(req: ClassificationRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    await check_model(st, req.model or st.settings.model_name, adapters=False, task="classify")
    c = st.classifier
    assert c is not None, "check_model lets only a classifier classify"
    inputs = embedding_inputs(req, st.builder)
    rid, logits = await embed(st, request, inputs, Pooling(task="classify"), started,
                              req.worker_id, "classify")  # fmt: skip
    data = [{"index": i, "label": c.labels[int(np.argmax(p))], "probs": p.tolist(),
             "num_classes": len(p)}
            for i, p in enumerate(class_probs(c, logits, req.use_activation))]  # fmt: skip
    n_tokens = sum(len(ids) for ids in inputs)
    return JSONResponse({
        "id": rid, "object": "list", "created": int(time.time()),
        "model": st.settings.model_name, "data": data,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }, headers={"x-request-id": rid})  # fmt: skip
