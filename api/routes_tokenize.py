"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, answered in the API process with
its own tokenizer and chat template (:class:`api.tokenization.PromptBuilder`): the same
ids a completion or chat request with that prompt would send to a worker.

``/tokenize`` takes a ``prompt`` (special tokens added by default) or chat ``messages``
(rendered with the chat template as chat renders them, ``tools`` and
``chat_template_kwargs`` included; generation prompt added by default, no special tokens
on top) and answers ``{count, max_model_len, tokens, token_strs}``; ``/detokenize`` takes
``tokens`` and answers ``{prompt}`` (special tokens kept). An id outside the vocabulary is
a 400; a ``model`` other than the served one a 404 (it may be left out, as vLLM allows).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from api.errors import bad_request
from api.protocol import ChatMessage
from api.state import api_state, check_model
from api.tokenization import PromptBuilder
from api.tools import tool_schemas

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    # with messages, as in chat: the tools the template lists, its extra variables
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    b = await _builder(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt", "invalid_value")
    if req.messages is not None:
        special = bool(req.add_special_tokens)
        if req.tools:
            tool_schemas(req.tools)  # checked as chat checks them
        ids = b.chat_prompt(req.messages, req.tools or None, req.add_generation_prompt,
                            req.continue_final_message, req.chat_template_kwargs,
                            special, req.documents, req.chat_template).token_ids  # fmt: skip
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = b.tokenizer.encode(req.prompt or "", add_special_tokens=special).ids
    strs = [b.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": b.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    b = await _builder(request, req.model)
    bad = [t for t in req.tokens if t >= b.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of vocabulary [0, {b.vocab_size})",
                          "tokens", "invalid_value")  # fmt: skip
    return {"prompt": b.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def _builder(request: Request, model: str | None) -> PromptBuilder:
    """The API's tokenizer and template, once ``model`` (if given) is served: the base
    model or one of its LoRA adapters (which tokenize as their base model does)."""
    st = api_state(request)
    if model is not None:
        await check_model(st, model)
    return st.builder
