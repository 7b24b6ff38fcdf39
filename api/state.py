"""What the API's routes share: built by the app's lifespan, found on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis
from starlette.requests import Request

from api.classifier import Classifier
from api.cluster_metrics import ClusterCollector
from api.errors import OpenAIError
from api.logprobs import TokenStrings
from api.media import MediaGuard
from api.metrics import ApiMetrics
from api.params import SamplingDefaults
from api.runner import Runner, RunningRequest
from api.streams import StreamHub
from api.tenants import TenantBudget
from api.tokenization import PromptBuilder
from cluster.conversations import ConversationStore
from cluster.lora import LoraRef, LoraRegistry
from cluster.response_store import ResponseStore
from tasks.settings import Settings


@dataclass
class ApiState:
    settings: Settings
    metrics: ApiMetrics
    cluster: ClusterCollector
    builder: PromptBuilder
    media: MediaGuard
    # set by the app's lifespan, before the first request is served
    redis: aioredis.Redis = field(init=False)
    hub: StreamHub = field(init=False)
    runner: Runner = field(init=False)
    tenants: TenantBudget = field(init=False)
    responses: ResponseStore = field(init=False)  # stored responses (the Responses API)
    conversations: ConversationStore = field(init=False)  # the Conversations API's
    loras: LoraRegistry = field(init=False)  # the LoRA adapters served (their registry)
    created: int = 0  # when the API started serving (the model's ``created``)
    tool_parser: str = "hermes"  # api.tool_parsers.PARSERS: reads tool_choice "auto" output
    strings: TokenStrings = field(init=False)  # token ids as logprobs show them
    # the model's classification head, if it is a sequence classifier (api.classifier)
    classifier: Classifier | None = None
    # /inference/v1/generate's requests in flight, by the client's request_id (for
    # /abort_requests)
    generating: dict[str, list[RunningRequest]] = field(default_factory=dict)
    # what a request that does not set a sampling field gets (the model's generation config)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        self.strings = TokenStrings(self.builder.tokenizer)


def api_state(request: Request) -> ApiState:
    return request.app.state.conveyor


# what each kind of endpoint asks of the model, as its refusal names it
TASKS = {"generate": "generation (chat, completions, responses)", "embed": "embeddings",
         "classify": "classification (/classify)"}  # fmt: skip


async def check_model(st: ApiState, name: str, adapters: bool = True,
                      task: str | None = None) -> LoraRef | None:  # fmt: skip
    """What ``name`` serves: the base model (None) or a registered LoRA adapter (its ref;
    one Redis read, for adapter names only). A 404 for any other name (OpenAI's
    ``model_not_found``); a 400 for an adapter where only the base model serves
    (``adapters`` False: embeddings and scores), and for a ``task`` (:data:`TASKS`) the
    model does not serve: a sequence classifier classifies and scores only, and only a
    classifier classifies."""
    served = st.settings.model_name
    lora = None
    if name not in st.settings.model_names:
        lora = await st.loras.get(name) if name else None
        if lora is None:
            raise OpenAIError(404, f"The model `{name}` does not exist. Available: `{served}` "
                              "and the LoRA adapters /v1/models lists.",
                              "invalid_request_error", "model", "model_not_found")  # fmt: skip
        if not adapters:
            raise OpenAIError(400, f"`{name}` is a LoRA adapter; it serves chat, completions "
                              f"and responses. This endpoint runs the base model `{served}`.",
                              "invalid_request_error", "model", "unsupported_model")  # fmt: skip
    if task is not None:
        check_task(st, task)
    return lora


def check_task(st: ApiState, task: str) -> None:
    """A 400 (``param: model``) when the served model does not serve ``task``."""
    c, served = st.classifier, st.settings.model_name
    if c is not None and task != "classify":
        raise OpenAIError(400, f"`{served}` is a sequence classifier ({c.architecture}): it "
                          "serves /classify, /score and /rerank, not "
                          f"{TASKS[task]}", "invalid_request_error", "model",
                          "unsupported_model")  # fmt: skip
    if c is None and task == "classify":
        raise OpenAIError(400, f"`{served}` has no classification head: /classify needs a "
                          "sequence classifier (a *ForSequenceClassification checkpoint)",
                          "invalid_request_error", "model", "unsupported_model")  # fmt: skip
