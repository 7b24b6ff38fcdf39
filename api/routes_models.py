"""The models served: ``GET /v1/models`` (and one by id), and LoRA adapters added and
removed at runtime (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

An Anthropic client (an ``anthropic-version`` header) gets Anthropic's shapes: a model
``{"type": "model", "id", "display_name", "created_at"}``, and a page of them with
``has_more``, ``first_id`` and ``last_id`` (``limit``, ``after_id``, ``before_id``).

The base model is this deployment's checkpoint; each LoRA adapter is a model of its own
whose ``parent`` is the base (as vLLM lists them). Adapters live in a Redis registry
(:class:`cluster.lora.LoraRegistry`), so one loaded through any API replica is listed and
served by all of them at once; the workers load an adapter's weights when a request first
names it (``workers/lora.py``). The API checks an adapter's ``adapter_config.json`` before
registering it, so a bad path or an unsupported adapter is a 400 here, not at its first
request.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from api.anthropic import cursor_page, page_body, rfc3339
from api.errors import OpenAIError, anthropic_client, bad_request
from api.state import ApiState, api_state
from cluster.lora import LoraError, LoraRef, check_name, parse_lora_modules, read_adapter

router = APIRouter()
log = logging.getLogger(__name__)


def _card(st: ApiState, lora: LoraRef | None = None, name: str | None = None) -> dict:
    """A model's card: the base model's (under ``name``, one of its served names) or a
    LoRA adapter's."""
    base = st.settings.model_name
    return {
        "id": (name or base) if lora is None else lora.name,
        "object": "model",
        "created": st.created,
        "owned_by": "conveyor",
        "root": str(st.settings.model) if lora is None else lora.path,
        "parent": None if lora is None else base,
        "max_model_len": st.builder.max_model_len,
    }


def _anthropic_card(card: dict) -> dict:
    return {"type": "model", "id": card["id"], "display_name": card["id"],
            "created_at": rfc3339(card["created"])}  # fmt: skip


@router.get("/v1/models")
async def list_models(
    request: Request, limit: int = Query(20, ge=1, le=1000), after_id: str | None = None,
    before_id: str | None = None,
) -> dict:  # fmt: skip
    st = api_state(request)
    adapters = await st.loras.all()
    cards = [_card(st, name=n) for n in st.settings.model_names]
    cards += [_card(st, a) for a in adapters]
    if not anthropic_client(request.scope):
        return {"object": "list", "data": cards}
    by_id = {c["id"]: c for c in cards}
    ids, has_more = cursor_page(list(by_id), limit, after_id, before_id)
    return page_body([_anthropic_card(by_id[i]) for i in ids], has_more)


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    st = api_state(request)
    card = _card(st, name=model) if model in st.settings.model_names else None
    if card is None and (lora := await st.loras.get(model)) is not None:
        card = _card(st, lora)
    if card is None:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                          "model", "model_not_found")  # fmt: skip
    return _anthropic_card(card) if anthropic_client(request.scope) else card


# --------------------------------------------------------------------------------------
class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what Conveyor keys adapters by


def checked(st: ApiState, name: str, path: str) -> LoraRef:
    """``name`` and ``path`` as an adapter this deployment can serve (400 otherwise)."""
    try:
        check_name(name)
    except LoraError as e:
        raise bad_request(str(e), "lora_name", "invalid_value") from None
    if name in st.settings.model_names:
        raise bad_request(f"`{name}` is the base model's name", "lora_name", "invalid_value")
    try:
        read_adapter(path, st.settings.engine.max_lora_rank)
    except LoraError as e:
        raise bad_request(str(e), "lora_path", "invalid_lora_adapter") from None
    return LoraRef(name=name, path=path)


def _runtime_updates(st: ApiState) -> None:
    if not st.settings.api.allow_runtime_lora_updating:
        raise OpenAIError(404, "loading and unloading LoRA adapters at runtime is off; set "
                          "CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING=true", "invalid_request_error",
                          None, "not_found")  # fmt: skip


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    st = api_state(request)
    _runtime_updates(st)
    ref = checked(st, body.lora_name, body.lora_path)
    if not body.load_inplace and await st.loras.get(ref.name) is not None:
        raise bad_request(f"The LoRA adapter `{ref.name}` is already loaded (load_inplace: "
                          "true replaces it)", "lora_name", "already_exists")  # fmt: skip
    await st.loras.add(ref)
    log.info("LoRA adapter %r added from %s", ref.name, ref.path)
    return PlainTextResponse(f"Success: LoRA adapter '{ref.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    st = api_state(request)
    _runtime_updates(st)
    if not await st.loras.remove(body.lora_name):
        raise OpenAIError(404, f"The LoRA adapter `{body.lora_name}` cannot be found.",
                          "invalid_request_error", "lora_name", "not_found")  # fmt: skip
    log.info("LoRA adapter %r removed", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def register_static(st: ApiState) -> list[LoraRef]:
    """The adapters of the ``lora_modules`` setting, checked and registered (the API
    refuses to start with one it cannot serve, as ``vllm serve`` does)."""
    refs = parse_lora_modules(st.settings.api.lora_modules)
    for ref in refs:
        try:
            checked(st, ref.name, ref.path)
        except OpenAIError as e:
            raise ValueError(f"lora_modules: adapter {ref.name!r}: {e.message}") from None
    if dropped := await st.loras.set_static(refs):
        log.info("LoRA adapters no longer in lora_modules, unregistered: %s", ", ".join(dropped))
    return refs
