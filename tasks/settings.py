"""Conveyor's one settings object, by area.

Every knob is read here, once, from the environment and from CLI flags that override it.
``Settings`` holds the deployment-wide fields and one object per area (``s.router``,
``s.engine``, ...); each component takes its area, or is built from it by one function,
so a default is written only here. Nothing else in the project reads ``os.environ``;
leaf classes in ``workers/`` and ``kvbm/`` take plain typed arguments.

Environment names are flat and unchanged from before the areas: ``CONVEYOR_<FLAT NAME>``,
where a field's flat name is its ``validation_alias`` (``router.mode`` is
``CONVEYOR_ROUTER_MODE``) or else its own name (``engine.block_size`` is
``CONVEYOR_BLOCK_SIZE``). The flat names also work as keyword arguments:
``Settings(block_size=32)``, ``configure(router_mode="random")`` (CLI flags). The two
mappings, ``vllm`` and ``mock``, nest with ``__``: ``CONVEYOR_VLLM__MAX_NUM_SEQS=8``.
``python -m tasks.settings --markdown`` writes docs/configuration.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from tasks.modes import MODE_NAMES, Mode, get_mode
from workers.mock_timing import MOCK_PROFILES

if TYPE_CHECKING:
    from workers.engine_api import EngineConfig

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "conveyor" / "models" / "tiny-llava"
DEFAULT_SERVE_DIR = Path.home() / ".cache" / "conveyor" / "serve"
DEFAULT_KVBM_DIR = Path.home() / ".cache" / "conveyor" / "kvbm"
GB = 1 << 30  # the KVBM sizes' "GB", as Dynamo's KVBM reads them


def _expand(v: object) -> object:
    return Path(v).expanduser() if isinstance(v, str) else v


UserPath = Annotated[Path, BeforeValidator(_expand)]  # "~/x" is the user's home


def _flat(name: str, default: Any, **kw: Any) -> Any:
    """A field whose flat name (environment, keyword argument) differs from its own."""
    return Field(default, validation_alias=name, **kw)


class _Area(BaseModel):
    """One area's settings; set by its own field names or by the flat names."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


class MockTimingSettings(BaseModel):
    """Simulated step time of the mock engine (``CONVEYOR_MOCK__<FIELD>``); the cost
    model, and where its presets' figures come from: workers/mock_timing.py."""

    profile: str | None = Field(
        None,
        exclude=True,  # resolved into the fields below; the engine gets those
        description=f"A named preset of every figure ({', '.join(sorted(MOCK_PROFILES))}); "
        "the other settings given beside it override its values.",
    )
    prefill_us_per_token: float = Field(100.0, ge=0, description="µs per prompt token.")
    prefill_quadratic_us: float = Field(
        0.0, ge=0, description="µs per prompt token per 1024 tokens of context (attention)."
    )
    decode_step_ms: float = Field(5.0, ge=0, description="ms of a step with one sequence.")
    decode_ms_per_seq: float = Field(0.05, ge=0, description="ms per further sequence.")
    decode_us_per_kv_token: float = Field(
        0.0, ge=0, description="µs per KV token a decoding sequence attends to, every step."
    )
    speedup: float = Field(1.0, gt=0, description="Divides every simulated time.")
    host_copy_us_per_block: float = Field(
        80.0, ge=0, description="µs to copy one KV block between G1 and host memory (G2)."
    )
    disk_us_per_block: float = Field(
        400.0, ge=0, description="µs to write or read one KV block on disk (G3)."
    )

    @model_validator(mode="after")
    def _apply_profile(self) -> MockTimingSettings:
        """The profile's figures, for every field not given explicitly."""
        if self.profile is None:
            return self
        if self.profile not in MOCK_PROFILES:
            raise ValueError(f"unknown mock profile {self.profile!r}; one of "
                             f"{sorted(MOCK_PROFILES)}")  # fmt: skip
        given = self.model_fields_set
        for name, value in MOCK_PROFILES[self.profile].items():
            if name not in given:
                object.__setattr__(self, name, value)
        return self


ToolCallParser = Literal[
    "hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "deepseek_v31",
    "kimi_k2", "glm45",
]  # fmt: skip


def _split(raw: str) -> list[str]:
    """Comma-separated names (blanks dropped)."""
    return [x.strip() for x in raw.split(",") if x.strip()]


def _names(raw: str) -> list[str]:
    """A setting's list: a JSON list, or comma-separated names (blank: none)."""
    raw = raw.strip()
    if raw.startswith("["):
        return [str(x).strip() for x in json.loads(raw) if str(x).strip()]
    return _split(raw)


def _json_text(v: object) -> object:
    """A JSON-object setting given as text (the environment's) read as its value; blank
    text is None."""
    if isinstance(v, str):
        return json.loads(v) if v.strip() else None
    return v


class ApiSettings(_Area):
    """The HTTP front: bind address, auth, limits, stream timeouts; Flower."""

    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8000, description="API port.")
    api_keys: str | None = Field(
        None,
        description="API keys clients must send as 'Authorization: Bearer <key>' (or "
        "'x-api-key: <key>'): comma-separated, or '@/path/to/file' with one per line; unset: "
        "no auth.",
    )
    api_keys_protect_ops: bool = Field(
        False, description="Require an API key for /health, /ping and /metrics too."
    )
    return_tokens_as_token_ids: bool = Field(
        False,
        description="Logprobs name each token 'token_id:<id>' rather than its text (vLLM's "
        "--return-tokens-as-token-ids; a request's return_tokens_as_token_ids overrides it): "
        "tokens that are no valid UTF-8 alone stay told apart.",
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="How tool calls are read out of the model's text for tool_choice "
        "'auto' (vLLM's --tool-call-parser names); default: the format the chat template "
        "asks for (qwen3_coder for <function=...><parameter=...> calls, glm45 for "
        "<arg_key> pairs, deepseek_v3 / deepseek_v31 for DeepSeek's call tokens, kimi_k2 for "
        "Kimi K2's, mistral for [TOOL_CALLS], pythonic for Llama 4's <|python_start|>, "
        "llama3_json for a Llama 3 template, else hermes).",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="A reasoning model's thinking (<think>...</think>) split from its answer "
        "(vLLM's --reasoning-parser): chat's reasoning field and the Responses API's "
        "reasoning item; unset: the output is all content.",
    )
    chat_template: str | None = Field(
        None,
        description="The chat template every request renders with, in place of the model's "
        "(vLLM's --chat-template): a Jinja file's path, or the template itself. The tool-call "
        "parser is then chosen from it.",
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Template variables every chat request gets unless its "
        "chat_template_kwargs sets them (vLLM's --default-chat-template-kwargs), a JSON "
        'object: {"enable_thinking": false} turns a Qwen3 model\'s thinking off by default.',
    )
    force_include_usage: bool = Field(
        False,
        description="Every stream carries its usage, on each chunk and in a last chunk, as "
        "if it asked for stream_options include_usage and continuous_usage_stats (vLLM's "
        "--enable-force-include-usage).",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Let a request bring its own chat_template (vLLM's "
        "--trust-request-chat-template), rendered in the same Jinja sandbox as the "
        "model's; off: such a request is a 400.",
    )
    reasoning_config: dict[str, str] | None = Field(
        None,
        description="The reasoning markers a request's thinking_token_budget counts "
        "between (vLLM's --reasoning-config), a JSON object: reasoning_start_str (default "
        "<think> with a reasoning parser) and reasoning_end_str, what is forced once the "
        "budget is spent (default </think>; it may put a phrase before it). Unset: the "
        "reasoning parser's markers; without either, thinking_token_budget is a 400.",
    )
    generation_config: str = Field(
        "auto",
        description="Where the sampling defaults of a request that does not set them come "
        "from (vLLM's --generation-config): 'auto', the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the "
        "default max_tokens); 'vllm', none (OpenAI's defaults); or a directory whose "
        "generation_config.json it is (its max_new_tokens then caps every request).",
    )
    override_generation_config: dict[str, Any] | None = Field(
        None,
        description="Sampling defaults over those of generation_config (vLLM's "
        "--override-generation-config), a JSON object of the same keys; its max_new_tokens "
        "caps every request's max_tokens.",
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, description="Request bodies above this get 413.")
    first_frame_timeout_s: float = Field(
        120.0, description="Seconds the API waits for a request's first stream frame."
    )
    frame_timeout_s: float = Field(
        30.0, description="Seconds the API waits between two frames of one stream."
    )
    shutdown_drain_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM (or Ctrl-C) an API process takes no new connection and lets "
        "the requests it serves run to their end for up to this long; a stream still open "
        "then ends with a 503 server_shutting_down error event (a whole response, a 503), "
        "and the process exits. A second signal exits at once.",
    )
    dispatch_attempts: int = Field(
        3, ge=1, description="Tries to start a request when its worker dies before answering."
    )
    resumable_streams: bool = Field(
        False,
        description="Workers also log every frame of a stream in a Redis Stream, SSE events "
        "carry id:, and a client that reconnects with Last-Event-ID (to any API replica) gets "
        "the rest of a chat or completion stream, nothing lost or repeated. Costs an XADD per "
        'frame (docs/performance.md, "Resumable streams").',
    )
    resume_grace_s: float = Field(
        0.0,
        ge=0,
        description="With resumable_streams: how long a request keeps running after its "
        "client disconnects, for it to reconnect; then it is cancelled. 0: at once.",
    )
    resume_ttl_s: float = Field(
        300.0,
        gt=0,
        description="With resumable_streams: how long a finished stream's frames stay resumable.",
    )
    responses_store: bool = Field(
        True,
        description="The Responses API stores a response unless its request says store: "
        "false (OpenAI's default): GET, DELETE and input_items answer for it on every API "
        "replica, and previous_response_id continues its conversation; the Conversations "
        "API keeps its conversations here too. Off: nothing is stored, as vLLM without "
        "VLLM_ENABLE_RESPONSES_API_STORE (and /v1/conversations answers 400).",
    )
    responses_store_ttl_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="How long a stored response, or a conversation (the Conversations "
        "API), is kept in Redis unused; a conversation continued with previous_response_id "
        "renews every turn it reads, and using a conversation renews it.",
    )
    lora_modules: str | None = Field(
        None,
        description="LoRA adapters served from the start, each a model clients may name: "
        "'name=/path/to/peft/dir' pairs separated by commas (vllm serve --lora-modules), "
        'or a JSON list of {"name", "path"}. Every worker must see the paths.',
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters added or removed at runtime, for every "
        "API replica at once.",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        description="Times a stream starts again from prompt + tokens so far (recomputed) "
        "when its worker dies mid-generation (on another worker of the pool) or its frames "
        "were lost while Redis was away (on any); 0: it ends with worker_lost or "
        "redis_unavailable.",
    )
    api_workers: int = Field(
        1,
        ge=1,
        description="API processes serving the one port (uvicorn's workers): each routes with "
        "its own view of the cluster and relays its own streams; more than one spreads the "
        "API's per-request and per-token work over the host's cores. /metrics then sums "
        "every process's counters (prometheus_client's multiprocess mode).",
    )
    allowed_origins: str = Field(
        "*",
        description="Origins a browser may call the API from (CORS, vLLM's --allowed-origins): "
        "comma-separated or a JSON list; '*' any (vLLM's default); empty: no CORS headers "
        "at all. Preflight requests are answered before API-key checks, as browsers send "
        "them without the key.",
    )
    allowed_methods: str = Field(
        "*", description="CORS: the methods allowed (comma-separated or a JSON list; '*' any)."
    )
    allowed_headers: str = Field(
        "*", description="CORS: the request headers allowed (comma-separated or a JSON list)."
    )
    allow_credentials: bool = Field(
        False, description="CORS: whether browsers may send credentials (cookies, auth)."
    )
    ssl_certfile: UserPath | None = Field(
        None,
        description="Serve the API over HTTPS with this certificate (PEM; vLLM's "
        "--ssl-certfile), its key in ssl_keyfile (or in the same file).",
    )
    ssl_keyfile: UserPath | None = Field(None, description="The HTTPS certificate's key (PEM).")
    ssl_ca_certs: UserPath | None = Field(
        None, description="CA certificates (PEM) that client certificates are checked against."
    )
    ssl_cert_reqs: int = Field(
        0,
        ge=0,
        le=2,
        description="Client certificates over HTTPS: 0 not asked for, 1 checked if sent, 2 "
        "required (Python's ssl.CERT_*; vLLM's --ssl-cert-reqs).",
    )
    root_path: str | None = Field(
        None,
        description="The path prefix a reverse proxy serves the API under (vLLM's "
        "--root-path): the OpenAPI docs and URLs the API writes carry it.",
    )
    flower_port: int = Field(5555, description="Flower port (conveyor serve).")
    flower_basic_auth: str | None = Field(
        None, description="user:password for Flower's basic auth (off when unset)."
    )
    flower_registry_queues: bool = Field(
        True,
        description="Flower's broker page lists the stage queues the worker registry knows "
        "(every pool's, each live worker's own, a departed worker's until it is empty); "
        "false: Flower's stock list (the queues the workers reported when Flower last "
        "inspected them).",
    )

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers")
    @classmethod
    def _list_setting(cls, v: str) -> str:
        try:
            _names(v)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a JSON list nor comma-separated names: {e}") from None
        return v

    @property
    def cors(self) -> dict[str, Any] | None:
        """Starlette's CORSMiddleware arguments (None: no CORS)."""
        origins = _names(self.allowed_origins)
        if not origins:
            return None
        return {"allow_origins": origins, "allow_methods": _names(self.allowed_methods),
                "allow_headers": _names(self.allowed_headers),
                "allow_credentials": self.allow_credentials}  # fmt: skip

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def api_key_list(self) -> list[str]:
        """The configured API keys (``api_keys``, or the lines of the file it names)."""
        raw = self.api_keys or ""
        if raw.startswith("@"):
            lines = Path(raw[1:]).expanduser().read_text().splitlines()
        else:
            lines = raw.split(",")
        return [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]

    @field_validator("override_generation_config", "default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, v: object) -> object:
        """JSON text (the environment's) read as its object."""
        v = _json_text(v)
        if v is not None and not isinstance(v, dict):
            raise ValueError("must be a JSON object")
        return v or None

    @field_validator("reasoning_config", mode="before")
    @classmethod
    def _reasoning_config(cls, v: object) -> object:
        """JSON text (the environment's) read as its object; only vLLM's two string keys
        (its reasoning_parser key is CONVEYOR_REASONING_PARSER here)."""
        v = _json_text(v)
        if isinstance(v, dict):
            if bad := sorted(set(v) - {"reasoning_start_str", "reasoning_end_str"}):
                raise ValueError(f"reasoning_config takes reasoning_start_str and "
                                 f"reasoning_end_str, not {', '.join(bad)}")  # fmt: skip
            if any(not isinstance(x, str) or not x for x in v.values()):
                raise ValueError("reasoning_config's strings must be non-empty strings")
        return v or None

    def reasoning_markers(self) -> tuple[str, str, str] | None:
        """The thinking budget's markers as text: (start, forced end, natural end), from
        ``reasoning_config`` over the reasoning parser's ``<think>`` / ``</think>`` (as
        vLLM derives them); None where neither names both ends."""
        cfg = self.reasoning_config or {}
        parsed = ("<think>", "</think>") if self.reasoning_parser else (None, None)
        start = cfg.get("reasoning_start_str") or parsed[0]
        end = cfg.get("reasoning_end_str") or parsed[1]
        if not start or not end:
            return None
        return start, end, parsed[1] or end


class AdmissionSettings(_Area):
    """Admission (api/admission.py; the per-worker cap is checked in the router's commit)."""

    worker_max_requests: int | None = Field(
        None,
        ge=0,
        description="Requests one worker may hold, running and queued, counted by every API "
        "replica at the router's commit; beyond it a request waits (admission_wait_s), then "
        "gets 503. Unset: 2 x max_num_seqs (a full batch running, one more waiting); 0: no "
        "cap.",
    )
    wait_s: float = _flat(
        "admission_wait_s",
        10.0,
        ge=0,
        description="How long a request waits for a worker under its cap before the API "
        "answers 503 server_overloaded (0: at once).",
    )
    client_max_requests: int = Field(
        0,
        ge=0,
        description="Requests one client (its API key when keys are set, else its address) "
        "may have in flight on one API process; beyond it 429. 0: no limit.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Retry-After (seconds) of the 503 and 429 admission answers."
    )
    tenant_tokens_per_min: int = Field(
        0,
        ge=0,
        description="Tokens (prompt + completion) one tenant (its API key when keys are set, "
        "else its address) may use per minute, counted in Redis across every API replica; "
        "a request that finds its tenant's minute spent gets 429 with Retry-After. 0: no "
        "budget.",
    )


class RouterSettings(_Area):
    """How the API picks a worker for each stage (tasks/router.py)."""

    mode: Literal["kv", "round_robin", "random"] = _flat(
        "router_mode", "kv", description="How the API picks a worker for each stage."
    )
    kv_events: bool = _flat(
        "router_kv_events",
        True,
        description="kv mode: use the index the workers' KV events feed; false: approximate "
        "mode (the router's own past decisions stand for cache contents, for a TTL).",
    )
    approx_ttl_s: float = _flat(
        "router_approx_ttl_s",
        120.0,
        gt=0,
        description="How long the approximate index remembers a decision.",
    )
    # the default, chosen on the trace replay (docs/performance.md, "Router: a block to
    # prefill weighs 8")
    overlap_weight: float = _flat(
        "router_overlap_weight",
        8.0,
        ge=0,
        description="Weight of a prompt block still to prefill against a block of running "
        "decode in the cost (prefill work is what delays a first token).",
    )
    temperature: float = _flat(
        "router_temperature",
        0.0,
        ge=0,
        description="0: lowest cost wins; >0: softmax sampling over costs.",
    )
    guard_ratio: float = _flat(
        "router_guard_ratio",
        1.5,
        ge=1,
        description="Load guard: a worker with more than ratio x the mean active blocks "
        "(and router_guard_min_blocks above the least loaded) gets no cache-affine traffic.",
    )
    guard_min_blocks: int = _flat(
        "router_guard_min_blocks",
        256,
        ge=0,
        description="Load guard: imbalance in blocks tolerated regardless of ratio.",
    )
    lease_s: float = _flat(
        "router_lease_s",
        30.0,
        ge=2,
        description="An API process's lease on the load (and request-cap slots) it counted "
        "on workers, renewed every second: one gone this long (killed) has its counts given "
        "back by the other API processes. Longer than any stall of a live one.",
    )
    g1_weight: float = _flat(
        "router_g1_weight",
        1.0,
        ge=0,
        description="Prefill a cached block saves when it is in the engine pool (G1).",
    )
    g2_weight: float = _flat(
        "router_g2_weight",
        0.75,
        ge=0,
        description="... when it is in the worker's host memory (G2: onboarded).",
    )
    g3_weight: float = _flat(
        "router_g3_weight",
        0.25,
        ge=0,
        description="... when it is on the worker's disk (G3: read back).",
    )


class WorkerSettings(_Area):
    """One `conveyor worker` process: its Celery side, heartbeat and CPUs."""

    id: str | None = _flat("worker_id", None, description="Worker id; default: generated.")
    concurrency: int = _flat(
        "worker_concurrency",
        64,
        ge=1,
        description="Celery task threads per worker (requests it can hold).",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per worker.")
    engine_cpus: str | None = Field(
        None,
        description="CPU list the engine process is pinned to (e.g. '1' or '2-3'); keeps "
        "the API, Redis and Celery off the engine's cores. Unset: no pinning.",
    )
    # niced by default (docs/performance.md, "Worker's Celery side niced")
    nice: int = _flat(
        "worker_nice",
        10,
        ge=0,
        le=19,
        description="Niceness of a worker's Celery side (task intake, events, acks), set "
        "once its engine process runs (which keeps the niceness it started with). On a "
        "host it shares with the API, its per-request bursts then no longer hold up the "
        "per-token relay; 0: leave it alone.",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="Worker heartbeat period.")
    ttl_s: float = _flat(
        "worker_ttl_s", 10.0, gt=0, description="A worker silent this long is dead."
    )
    engine_hang_timeout_s: float = Field(
        60.0,
        ge=0,
        description="An engine process that sends nothing (not even its stats, 4 times a "
        "second) this long, or is this long in one engine step, is taken for hung (a GPU "
        "hang, a deadlock): its worker kills it and ends as on an engine death, so its "
        "requests move to other workers and the supervisor starts it again. 0: never.",
    )


class EngineSettings(_Area):
    """The engine in each worker's engine process: its kind, pool and batch limits."""

    kind: Literal["reference", "mock", "vllm"] = _flat(
        "engine",
        "reference",
        description="reference: the torch engine; mock: real scheduler and KV blocks, "
        "simulated step times and placeholder tokens (routing studies; agg mode); vllm: "
        "vLLM's async engine in the engine process (its own install: docs/vllm.md).",
    )
    device: str = Field("cpu", description="torch device for the reference engine.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight and KV dtype of the reference engine."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    num_kv_blocks: int = Field(2048, ge=1, description="KV blocks in each worker's pool.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together per step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step (prefill chunks + decodes)."
    )
    max_model_len: int | None = Field(
        None, description="Context window; default: the model's max_position_embeddings."
    )
    scheduler_delay_factor: float = Field(
        0.0,
        ge=0.0,
        description="While sequences decode, a new prompt waits this many times the last "
        "prefill step's duration (vLLM's scheduler_delay_factor); 0: admitted at once.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens per stream frame (vLLM's --stream-interval): a request's "
        "outputs are held until this many tokens are, then sent as one frame; its first "
        "token and its last frame (finish, error, abort) go out at once. Fewer frames cut "
        "the engine's, Redis's and the API's CPU per token where the engine outruns the "
        "pipeline; the API sees a gap of this many tokens' time between frames. 1: a frame "
        "per engine step.",
    )
    decode_attention: Literal["auto", "kernel", "torch"] = Field(
        "auto",
        description="Decode attention of the reference engine: kernel (a C kernel that "
        "reads KV blocks in place; float32 on CPU; built with the host's cc on first use), "
        "torch (gather the blocks, then SDPA), auto (the kernel where it builds, else torch).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse cached KV blocks of shared prompt prefixes (by block hash)."
    )
    speculative_config: dict | None = Field(
        None,
        description="Speculative decoding (vLLM's --speculative-config), a JSON object: "
        'the reference engine serves the ngram method ({"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": '
        "2}: drafts looked up in the request's own context, checked in one forward pass, "
        "for greedy and sampled requests); the vLLM engine gets it as its flag. Unset: off.",
    )
    max_loras: int = Field(
        8,
        ge=1,
        description="LoRA adapters a worker keeps loaded (least recently used goes first; "
        "one in use stays). A batch may mix any of them with the base model.",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="The highest LoRA rank served (vLLM's --max-lora-rank)."
    )
    kv_pin_timeout_s: float = Field(
        60.0, gt=0, description="Prefilled KV no decode worker pulled is freed after this."
    )
    kernel_dir: UserPath | None = Field(
        None,
        description="Where the decode kernel is built and found (a file per source, "
        "compiler and CPU); unset: $XDG_CACHE_HOME/conveyor/kernels, else "
        "~/.cache/conveyor/kernels. The container image sets a directory built with it.",
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec(cls, v: object) -> object:
        """JSON text (the environment's) read as its object. vLLM's methods other than
        ngram pass (the vLLM engine serves them); the ngram method's keys are checked here,
        where a mistake is a start-up error."""
        if isinstance(v, str):
            v = json.loads(v) if v.strip() else None
        if isinstance(v, dict) and v and v.get("method", "ngram") == "ngram":
            from workers.spec_decode import SpecConfig  # torch-free

            SpecConfig.parse(v)
        return v or None

    def kernel_path(self) -> Path:
        """``kernel_dir``, or its default under the user's cache directory."""
        if self.kernel_dir is not None:
            return self.kernel_dir
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(cache) / "conveyor" / "kernels"


class KvbmSettings(_Area):
    """KVBM tiers below each worker's engine pool (Dynamo KVBM's names)."""

    cpu_cache_gb: float = _flat(
        "kvbm_cpu_cache_gb",
        0.0,
        ge=0,
        description="G2: host memory for KV blocks offloaded from the engine pool, in GB "
        "(2^30 bytes); 0: off.",
    )
    cpu_cache_blocks: int | None = _flat(
        "kvbm_cpu_cache_blocks",
        None,
        ge=0,
        description="G2 size in blocks (overrides kvbm_cpu_cache_gb).",
    )
    disk_cache_gb: float = _flat(
        "kvbm_disk_cache_gb",
        0.0,
        ge=0,
        description="G3: local disk for KV blocks, in GB (2^30 bytes); 0: off.",
    )
    disk_cache_blocks: int | None = _flat(
        "kvbm_disk_cache_blocks",
        None,
        ge=0,
        description="G3 size in blocks (overrides kvbm_disk_cache_gb).",
    )
    disk_dir: UserPath = _flat(
        "kvbm_disk_dir",
        DEFAULT_KVBM_DIR,
        description="G3's files: <dir>/<model namespace>/slot-<k>/, one slot per live worker; "
        "a worker restarted on the same host takes over a slot's blocks.",
    )
    disk_offload_filter: bool = _flat(
        "kvbm_disk_offload_filter",
        True,
        description="G3 admits a block once it was stored and hit twice (Dynamo's frequency "
        "filter); false: every block offloaded to G2 is written to G3 too.",
    )

    def tier_blocks(self, block_bytes: int) -> tuple[int, int]:
        """(G2 blocks, G3 blocks) for blocks of ``block_bytes``: the block counts where
        given, else the GB sizes; 0 = tier off."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        host = self.cpu_cache_blocks
        disk = self.disk_cache_blocks
        if host is None:
            host = int(self.cpu_cache_gb * GB // block_bytes)
        if disk is None:
            disk = int(self.disk_cache_gb * GB // block_bytes)
        return host, disk


class TransferSettings(_Area):
    """Disaggregated serving: how prefilled KV (and image embeddings) move between workers."""

    backend: Literal["auto", "nixl", "redis"] = _flat(
        "kv_transfer",
        "auto",
        description="How prefill KV reaches decode workers (auto: NIXL, else Redis).",
    )
    threads: int = _flat(
        "kv_transfer_threads",
        2,
        ge=1,
        description="NIXL: threads that pull one transfer's blocks in parallel (16 MiB and up).",
    )
    timeout_s: float = _flat(
        "transfer_timeout_s",
        10.0,
        gt=0,
        description="Limit of one KV pull (below frame_timeout_s, so a stuck pull "
        "is retried before the client gives up).",
    )
    prefill_retries: int = Field(
        2, ge=0, description="Re-prefills after a failed KV pull before the request fails."
    )
    disagg_min_prompt_tokens: int = Field(
        256, ge=0, description="Shorter prompts are prefilled on the decode worker itself."
    )


class MultimodalSettings(_Area):
    """Image parts: the API's media guard (api/media.py) and the encode workers."""

    allow_http: bool = _flat(
        "media_allow_http",
        False,
        description="Also fetch http:// image URLs (default: https:// and data: only).",
    )
    allow_internal: bool = _flat(
        "media_allow_internal",
        False,
        description="Fetch from loopback, private, link-local, multicast, reserved and "
        "unspecified addresses too (default: refused after DNS resolution; tests, "
        "in-cluster image stores).",
    )
    max_bytes: int = _flat(
        "media_max_bytes",
        20 * 1024 * 1024,
        ge=1,
        description="Largest image (encoded bytes) fetched or decoded.",
    )
    max_pixels: int = _flat(
        "media_max_pixels",
        4096 * 4096,
        ge=1,
        description="Largest image in pixels (width x height).",
    )
    fetch_timeout_s: float = _flat(
        "media_fetch_timeout_s",
        10.0,
        gt=0,
        description="Limit of one image URL's fetch: DNS, redirects and body.",
    )
    max_images: int = _flat("media_max_images", 8, ge=0, description="Most images in one request.")
    ttl_s: int = _flat(
        "media_ttl_s",
        600,
        ge=1,
        description="How long an image's bytes stay in Redis for the workers (a request "
        "must start within it).",
    )
    ca_bundle: UserPath | None = _flat(
        "media_ca_bundle",
        None,
        description="CA bundle (PEM) for https image URLs; unset: the system's.",
    )
    encoder_cache_mb: int = Field(
        256,
        ge=0,
        description="MiB of image embeddings each encoding worker keeps (LRU, by the "
        "image's content hash): an image seen before skips the vision tower; 0: off.",
    )
    encoder_max_batch: int = Field(
        16,
        ge=1,
        description="Images an encode worker puts through its vision tower in one forward "
        "(the images of the requests waiting, up to this many); 1: no batching.",
    )


class ServeSettings(_Area):
    """`conveyor serve`: the processes it starts, its embedded Redis and its supervision."""

    workers: int = Field(1, ge=0, description="Worker processes per pool (conveyor serve).")
    encode_workers: int | None = Field(
        None,
        ge=0,
        description="Encode workers in the e-pd and e-p-d modes (serve); default: workers.",
    )
    prefill_workers: int | None = Field(
        None, ge=0, description="Prefill workers in disagg mode (serve); default: workers."
    )
    decode_workers: int | None = Field(
        None, ge=0, description="Decode workers in disagg mode (serve); default: workers."
    )
    redis_appendonly: bool = Field(
        False,
        description="Embedded Redis keeps an append-only file in its data dir, so queued "
        "messages survive a restart of it (fsync every second).",
    )
    restart: bool = _flat(
        "serve_restart",
        True,
        description="conveyor serve restarts a process that exits on its own; false: stop "
        "everything instead (debugging).",
    )
    restart_backoff_s: float = _flat(
        "serve_restart_backoff_s",
        1.0,
        gt=0,
        description="Delay before the first restart; doubles with each early exit.",
    )
    restart_backoff_max_s: float = _flat(
        "serve_restart_backoff_max_s",
        30.0,
        gt=0,
        description="Longest delay between an exit and its restart.",
    )
    crash_loop_exits: int = _flat(
        "serve_crash_loop_exits",
        5,
        ge=1,
        description="This many early exits in a row of one process stop serve.",
    )
    crash_loop_window_s: float = _flat(
        "serve_crash_loop_window_s",
        60.0,
        gt=0,
        description="An exit this soon after its start is early (crash loops, backoff).",
    )
    drain_timeout_s: float = _flat(
        "serve_drain_timeout_s",
        120.0,
        gt=0,
        description="A worker serve drains (scaled down: SIGTERM, it finishes what it holds) "
        "is killed if still running after this long.",
    )
    state_dir: UserPath = _flat(
        "serve_state_dir",
        DEFAULT_SERVE_DIR,
        description="Where serve writes its process table (<api port>.json, read by "
        "conveyor status) and the embedded Redis's data dir (redis-<port>/).",
    )

    def workers_in(self, pool: str) -> int:
        """How many workers ``conveyor serve`` starts for ``pool``."""
        own = {"encode": self.encode_workers, "prefill": self.prefill_workers,
               "decode": self.decode_workers}.get(pool)  # fmt: skip
        return self.workers if own is None else own


class BatchSettings(_Area):
    """The Files and Batch APIs (api/routes_batches.py, tasks/batches.py)."""

    files_dir: UserPath = Field(
        Path.home() / ".cache" / "conveyor" / "files",
        description="Where uploaded files and batch outputs live (one directory behind "
        "tasks.files.FileStore; API replicas on several hosts need it shared).",
    )
    max_in_flight: int = _flat(
        "batch_max_in_flight",
        8,
        ge=1,
        description="Requests of one batch in flight at once.",
    )
    load_threshold: float = _flat(
        "batch_load_threshold",
        0.5,
        gt=0,
        le=1,
        description="A batch request is sent only while its pool's workers hold fewer than "
        "this share of their request cap (running and queued, every API replica's): online "
        "requests go first.",
    )
    priority: int = _flat(
        "batch_priority",
        100,
        description="The priority a batch request runs at when its line sets none (vLLM's: "
        "lower first; online requests default to 0).",
    )
    api_url: str | None = _flat(
        "batch_api_url",
        None,
        description="Where the batch runner sends a batch's requests; default: this host's "
        "API (host and port settings).",
    )
    lease_s: float = _flat(
        "batch_lease_s",
        30.0,
        gt=0,
        description="A batch's runner holds it under a lease it renews (every quarter of "
        "this); a runner that dies without a word (SIGKILL, OOM) leaves it for this long.",
    )
    recover_s: float = _flat(
        "batch_recover_s",
        10.0,
        gt=0,
        description="Every live batch runner looks this often for batches in progress that "
        "nobody holds and queues them again.",
    )


class PlannerSettings(_Area):
    """The SLA planner (``conveyor planner``, ``conveyor serve --planner``): its targets,
    loops, bounds and where its decisions go (planner/, README "Scaling")."""

    enabled: bool = _flat(
        "planner", False, description="conveyor serve runs the planner and scales its own "
        "worker processes (the serve connector)."
    )  # fmt: skip
    connector: Literal["advisory", "virtual", "compose", "kubernetes", "serve"] = _flat(
        "planner_connector", "advisory", description="Where decisions go (conveyor planner; "
        "serve --planner always uses serve)."
    )  # fmt: skip
    pools: str | None = _flat(
        "planner_pools", None, description="Comma-separated pools to size; default: the "
        "mode's worker pools."
    )  # fmt: skip
    ttft_ms: float = _flat("planner_ttft_ms", 1000.0, gt=0, description="TTFT p90 target.")
    itl_ms: float = _flat("planner_itl_ms", 50.0, gt=0, description="ITL p90 target.")
    load_interval_s: float = _flat(
        "planner_load_interval_s", 5.0, gt=0, description="The load loop's period."
    )  # fmt: skip
    throughput_interval_s: float = _flat(
        "planner_throughput_interval_s", 180.0, gt=0,
        description="The throughput loop's period (forecast and floor).",
    )  # fmt: skip
    window_s: float = _flat(
        "planner_window_s", 30.0, gt=0, description="The API traffic window each tick reads."
    )  # fmt: skip
    min_workers: int = _flat("planner_min_workers", 1, ge=0, description="Per pool.")
    max_workers: int = _flat("planner_max_workers", 8, ge=1, description="Per pool.")
    gpu_budget: int = _flat(
        "planner_gpu_budget", 8, ge=1, description="GPUs all pools together may hold."
    )  # fmt: skip
    gpus_per_worker: str | None = _flat(
        "planner_gpus_per_worker", None, description="GPUs a worker of a pool holds, e.g. "
        "'prefill=2,decode=1'; default 1."
    )  # fmt: skip
    sensitivity: float = _flat(
        "planner_sensitivity", 0.7, gt=0, le=1, description="Scale down only when every "
        "worker's estimate is under this share of each target."
    )  # fmt: skip
    forecaster: Literal["constant", "kalman", "arima"] = _flat(
        "planner_forecaster", "kalman", description="The throughput loop's forecast."
    )  # fmt: skip
    hold_timeout_s: float = _flat(
        "planner_hold_timeout_s", 300.0, gt=0, description="Longest wait for a scaling action "
        "to take effect before the pool is sized again."
    )  # fmt: skip
    compose_services: str | None = _flat(
        "planner_compose_services", None, description="compose connector: pool=service, "
        "comma-separated (e.g. 'generate=worker')."
    )  # fmt: skip
    compose_project: str | None = _flat(
        "planner_compose_project", None, description="compose connector: the project; "
        "default: the planner's own container's."
    )  # fmt: skip
    docker_host: str | None = _flat(
        "planner_docker_host", None, description="compose connector: the Docker socket "
        "(unix://...); default DOCKER_HOST or /var/run/docker.sock."
    )  # fmt: skip
    k8s_api: str | None = _flat(
        "planner_k8s_api", None, description="kubernetes connector: API server URL; default "
        "in-cluster."
    )  # fmt: skip
    k8s_namespace: str | None = _flat(
        "planner_k8s_namespace", None, description="kubernetes connector: namespace; "
        "default the pod's."
    )  # fmt: skip
    k8s_token_file: str | None = _flat(
        "planner_k8s_token_file", None, description="kubernetes connector: bearer token file; "
        "default the service account's."
    )  # fmt: skip
    k8s_ca_file: str | None = _flat(
        "planner_k8s_ca_file", None, description="kubernetes connector: CA bundle; default "
        "the service account's."
    )  # fmt: skip
    k8s_deployments: str | None = _flat(
        "planner_k8s_deployments", None, description="kubernetes connector: pool=deployment, "
        "comma-separated."
    )  # fmt: skip
    record: UserPath | None = _flat(
        "planner_record", None, description="Append every tick's observation to this JSONL "
        "file (conveyor planner --dry-run replays it)."
    )  # fmt: skip
    metrics_port: int | None = _flat(
        "planner_metrics_port", None, description="conveyor planner serves /metrics here too "
        "(every API's /metrics shows the planner's state anyway)."
    )  # fmt: skip


AREAS: dict[str, type[_Area]] = {
    "api": ApiSettings,
    "admission": AdmissionSettings,
    "router": RouterSettings,
    "worker": WorkerSettings,
    "engine": EngineSettings,
    "kvbm": KvbmSettings,
    "transfer": TransferSettings,
    "multimodal": MultimodalSettings,
    "serve": ServeSettings,
    "batch": BatchSettings,
    "planner": PlannerSettings,
}


def _flat_names() -> dict[str, tuple[str, str]]:
    """flat name -> (area, field) for every area field."""
    out = {}
    for area, cls in AREAS.items():
        for name, f in cls.model_fields.items():
            flat = f.validation_alias if isinstance(f.validation_alias, str) else name
            assert flat not in out, f"two settings share the flat name {flat!r}"
            out[flat] = (area, name)
    return out


FLAT = _flat_names()


def field_info(flat: str) -> FieldInfo:
    """The field whose flat name (``CONVEYOR_<FLAT>``) is ``flat``; KeyError if none."""
    if flat in FLAT:
        area, name = FLAT[flat]
        return AREAS[area].model_fields[name]
    if flat in AREAS or flat not in Settings.model_fields:
        raise KeyError(flat)
    return Settings.model_fields[flat]


class _FlatEnvSource(EnvSettingsSource):
    """The environment, with every area field under its flat name (``CONVEYOR_PORT``,
    ``CONVEYOR_ROUTER_MODE``); the top-level fields as pydantic-settings reads them."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name in AREAS:
            return None, field_name, False
        return super().get_field_value(field, field_name)

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any,
                            value_is_complex: bool) -> Any:  # fmt: skip
        if field_name in AREAS:
            return None
        return super().prepare_field_value(field_name, field, value, value_is_complex)

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for flat, (area, name) in FLAT.items():
            value = self.env_vars.get(f"conveyor_{flat}")
            if value is not None:
                data.setdefault(area, {})[name] = value
        return data


class _FlatInit(PydanticBaseSettingsSource):
    """Keyword arguments, flat names (``block_size=32``) nested into their areas, so they
    merge with (and win over) the environment's values of the same areas."""

    def __init__(self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self.inner = inner

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the keyword arguments

    def __call__(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        flat: dict[str, Any] = {}
        for key, value in self.inner().items():
            # "engine" names an area and a flat field (engine.kind): a mapping is the area
            if key in FLAT and not (key in AREAS and isinstance(value, dict | BaseModel)):
                flat[key] = value
            else:
                data[key] = value.model_dump() if isinstance(value, _Area) else value
        for key, value in flat.items():
            area, name = FLAT[key]
            data[area] = {**data.get(area, {}), name: value}
        return data


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="ignore"
    )

    # --- deployment-wide (every process) ---------------------------------------------
    model: UserPath = Field(DEFAULT_MODEL_DIR, description="Hugging Face model directory.")
    served_model_name: str | None = Field(
        None,
        description="Model id clients send; default: the model directory's name. Several, "
        "comma-separated (vLLM's --served-model-name a b): any of them names the model; the "
        "first is its id (in /v1/models first, in logs, metrics and KV block names).",
    )
    mode: str = Field(
        "agg", description=f"Serving mode, a row of the stage table: {', '.join(MODE_NAMES)}."
    )
    redis_url: str | None = Field(
        None, description="External Redis; unset: `serve` starts an embedded redis-server."
    )
    redis_port: int = Field(6390, description="Port of the embedded Redis (conveyor serve).")
    redis_password: str | None = Field(
        None,
        description="Password of the embedded Redis (serve); unset: serve generates one and "
        "keeps it in its data dir (mode 0600), where the tools on this host find it.",
    )
    log_requests: bool = Field(
        False,
        description="Log a line per request: the API's as it sends it, the worker's as it "
        "finishes, and Celery's task received / succeeded lines (vLLM's "
        "--enable-log-requests). Off: those lines are DEBUG, as they cost CPU per request.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="How every process logs (Flower aside): text lines, or json, one "
        "object per line with time, level, logger, pid, message, and request_id, trace_id "
        "and span_id where known (as Dynamo's DYN_LOGGING_JSONL); also `conveyor "
        "--log-format`.",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="Send OpenTelemetry traces here (vLLM's --otlp-traces-endpoint): a span "
        "per HTTP request on the API, its admission and routing, and each stage task on its "
        "worker, in the caller's trace when it sends a traceparent header. An http(s) URL: "
        "the collector's OTLP/HTTP traces URL (a bare host:port gets /v1/traces), or its "
        "gRPC address with otlp_traces_protocol=grpc. Unset: no tracing, at no cost.",
    )
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf",
        description="OTLP transport of the traces: http/protobuf (built in) or grpc (pip "
        "install 'conveyor[tracing-grpc]'). OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER and the "
        "exporter's other OTEL_* variables apply as the OpenTelemetry SDK reads them.",
    )
    broker_fastpath: bool = Field(
        True,
        description="Use Conveyor's fast paths through kombu, Celery and redis-py (batched "
        "acks and events, deferred sends, hand-written RESP for frames and routing); "
        "false: the libraries' stock behaviour.",
    )
    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine options (engine=vllm), as `vllm serve` flags without their "
        "dashes: CONVEYOR_VLLM__MAX_NUM_SEQS=8, CONVEYOR_VLLM__ENFORCE_EAGER=true, "
        "CONVEYOR_VLLM__KV_TRANSFER_CONFIG='{\"kv_connector\": ...}'; --vllm-arg KEY=VALUE "
        "on the command line.",
    )
    mock: MockTimingSettings = Field(
        default_factory=MockTimingSettings,
        description="Mock engine timing; CONVEYOR_MOCK__DECODE_STEP_MS=5 and so on.",
    )

    # --- areas -------------------------------------------------------------------------
    api: ApiSettings = Field(default_factory=ApiSettings, description="The HTTP front.")
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings, description="Admission."
    )
    router: RouterSettings = Field(default_factory=RouterSettings, description="Routing.")
    worker: WorkerSettings = Field(default_factory=WorkerSettings, description="Workers.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Engine.")
    kvbm: KvbmSettings = Field(default_factory=KvbmSettings, description="KVBM tiers.")
    transfer: TransferSettings = Field(default_factory=TransferSettings, description="KV transfer.")
    multimodal: MultimodalSettings = Field(
        default_factory=MultimodalSettings, description="Images."
    )
    serve: ServeSettings = Field(default_factory=ServeSettings, description="conveyor serve.")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="Files and batches.")
    planner: PlannerSettings = Field(default_factory=PlannerSettings, description="Planner.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env = _FlatEnvSource(settings_cls)
        return _FlatInit(settings_cls, init_settings), env, file_secret_settings

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        get_mode(v)  # ValueError listing the known modes
        return v

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _traces_url(cls, v: str | None) -> str | None:
        if v and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).hostname):
            raise ValueError(f"{v!r} is not an http(s) URL of an OTLP collector "
                             "(http://collector:4318/v1/traces)")  # fmt: skip
        return v or None

    def to_env(self) -> dict[str, str]:
        """Every field that is set, as the ``CONVEYOR_*`` variable that sets it (how
        ``conveyor serve`` hands its settings to the processes it starts)."""
        values: dict[str, Any] = {n: getattr(self, n) for n in type(self).model_fields
                                  if n not in AREAS}  # fmt: skip
        values |= {flat: getattr(getattr(self, a), n) for flat, (a, n) in FLAT.items()}
        out = {}
        for flat, value in values.items():
            if isinstance(value, BaseModel):
                value = value.model_dump()
            if value is not None:
                out[f"CONVEYOR_{flat.upper()}"] = (
                    json.dumps(value) if isinstance(value, dict) else str(value)
                )
        return out

    # --- derived -------------------------------------------------------------------------
    @property
    def effective_redis_url(self) -> str:
        """``redis_url``, else the embedded Redis's, with its password (``redis_password``,
        else the one ``serve`` generated for its data dir, readable on this host only)."""
        if self.redis_url:
            return self.redis_url
        password = self.redis_password
        if password is None and self.redis_password_file.is_file():
            password = self.redis_password_file.read_text().strip()
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.redis_port}/0"

    @property
    def redis_url_for_logs(self) -> str:
        """``effective_redis_url`` with its password masked (for logs and messages)."""
        u = urlsplit(self.effective_redis_url)
        if u.password is None:
            return u.geturl()
        host = u.netloc.rpartition("@")[2]
        return u._replace(netloc=f"{u.username or ''}:***@{host}").geturl()

    @property
    def effective_worker_max_requests(self) -> int:
        """``worker_max_requests``, else two full batches (``max_num_seqs``) per worker."""
        if self.admission.worker_max_requests is None:
            return 2 * self.engine.max_num_seqs
        return self.admission.worker_max_requests

    @property
    def redis_password_file(self) -> Path:
        """Where ``serve`` keeps the embedded Redis's generated password (mode 0600)."""
        return self.redis_data_dir / "password"

    @property
    def serve_state_file(self) -> Path:
        """The process table of the ``conveyor serve`` whose API listens on ``api.port``."""
        return self.serve.state_dir / f"{self.api.port}.json"

    @property
    def redis_data_dir(self) -> Path:
        """The embedded Redis's working directory (its append-only file, if any)."""
        return self.serve.state_dir / f"redis-{self.redis_port}"

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """Every name the model is served under (served_model_name's, else the directory's)."""
        return _split(self.served_model_name or "") or [self.model.name]

    @property
    def serving_mode(self) -> Mode:
        """This deployment's row of the stage table."""
        return get_mode(self.mode)

    @property
    def pools(self) -> tuple[str, ...]:
        return self.serving_mode.pools


_settings: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, built once from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings()
    return _settings


def configure(**overrides: Any) -> Settings:
    """Build the process-wide settings from the environment plus explicit overrides
    (CLI flags); ``None`` values are ignored so an absent flag leaves the env value."""
    global _settings
    _settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    return _settings


def engine_config(s: Settings | None = None, **overrides: Any) -> EngineConfig:
    """The engine's configuration (workers.engine_api.EngineConfig, which restates no
    default) from the engine and KVBM areas of ``s``, with ``overrides`` on top: what
    `conveyor worker` adds (the model's namespace, the tiers' blocks), a test's or a
    bench's sizes. ``s`` None: the areas' defaults, not the environment (tests, benches)."""
    from workers.engine_api import EngineConfig  # here: the API process loads no workers

    engine = s.engine if s is not None else EngineSettings()
    kvbm = s.kvbm if s is not None else KvbmSettings()
    fields = {
        **engine.model_dump(exclude={"kind", "kernel_dir"}),
        "kernel_dir": str(engine.kernel_path()),
        "disk_dir": str(kvbm.disk_dir),
        "disk_offload_filter": kvbm.disk_offload_filter,
    }
    if s is not None:  # adapters are named at start or may be loaded at runtime
        fields["enable_lora"] = bool(s.api.lora_modules) or s.api.allow_runtime_lora_updating
    return EngineConfig(**{**fields, **overrides})


# ----------------------------------------------------------------------------------------
# docs/configuration.md
# ----------------------------------------------------------------------------------------
def _type_name(t: Any) -> str:
    """A field's type for the table: ``int``, ``kv / round_robin / random``, ``Path``."""
    origin, args = get_origin(t), get_args(t)
    if origin is Literal:
        return " / ".join(str(a) for a in args)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is dict:
        return "mapping"
    return getattr(t, "__name__", str(t))


def _default_text(f: FieldInfo) -> str:
    value = f.get_default(call_default_factory=True)
    value = value.model_dump() if isinstance(value, BaseModel) else value
    if value is None:
        return "unset"
    if isinstance(value, Path):
        value = str(value).replace(str(Path.home()), "~")
    return f"`{json.dumps(value) if isinstance(value, dict) else value}`"


def _rows(fields: dict[str, FieldInfo], env: dict[str, str]) -> list[str]:
    rows = ["| Environment variable | Field | Type | Default | Description |",
            "|---|---|---|---|---|"]  # fmt: skip
    for name, f in fields.items():
        desc = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{env[name]}` | `{name}` | {_type_name(f.annotation)} "
                    f"| {_default_text(f)} | {desc} |")  # fmt: skip
    return rows


def markdown() -> str:
    """docs/configuration.md: every setting by area, with its environment variable, type,
    default and description (tests/unit/tasks/test_settings.py keeps the file in step)."""
    out = [
        "# Configuration",
        "",
        "<!-- generated by `python -m tasks.settings --markdown > docs/configuration.md` "
        "from tasks/settings.py; edit the Field descriptions there, not this file -->",
        "",
        "Every setting is an environment variable (`CONVEYOR_...`); the `conveyor` "
        "commands' flags set the same fields and win over the environment. In code, a "
        "setting is `Settings().<area>.<field>` (the deployment-wide ones: "
        "`Settings().<field>`).",
        "",
        "## Deployment-wide",
        "",
    ]
    top = {n: f for n, f in Settings.model_fields.items()
           if n not in AREAS and n not in ("vllm", "mock")}  # fmt: skip
    out += _rows(top, {n: f"CONVEYOR_{n.upper()}" for n in top})
    for area, cls in AREAS.items():
        env = {name: f"CONVEYOR_{flat.upper()}" for flat, (a, name) in FLAT.items() if a == area}
        out += ["", f"## {area}", "", (cls.__doc__ or "").strip(), ""]
        out += _rows(dict(cls.model_fields), env)
    out += ["", "## vllm", "", Settings.model_fields["vllm"].description or "", ""]
    out += ["## mock", "", (MockTimingSettings.__doc__ or "").strip(), ""]
    mock = dict(MockTimingSettings.model_fields)
    out += _rows(mock, {n: f"CONVEYOR_MOCK__{n.upper()}" for n in mock})
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m tasks.settings --markdown > docs/configuration.md")
    sys.stdout.write(markdown())
