"""The engine interface: what the worker runtime, the engine process and the stage tasks
see of an engine, and the types that cross it. torch-free.

An engine runs requests in steps (continuous batching): ``add_request`` queues one,
``step`` computes one step for every running request and returns their outputs. A request
runs whole (aggregated), or stops after its first token holding its prompt's KV for a
decode worker to pull (``prefill_only``), or decodes after a prefill worker's first token
(``imported``); a request waits in a "loading KV" state while its KV comes in (blocks of
its prefix onboarded from the lower KVBM tiers, or a disaggregated prefill's KV pulled by
its :class:`KVSource`) as the others keep running. Implementations:
:class:`workers.engine.Engine` (the torch reference) and
:class:`workers.mock_engine.MockEngine` (simulated time), both built on
:class:`workers.engine_core.EngineCore`, and
:class:`workers.vllm_engine.VllmEngine` (vLLM's async engine, which computes in processes
of its own: its ``step`` blocks until outputs come, ``wake`` returns it early).

Nothing outside an engine touches its block pool or its tensors: the engine process asks
for :meth:`Engine.kv_memory` (what a KV transfer backend moves) and :meth:`Engine.stats`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from cluster.lora import LoraRef
from cluster.stats import EngineStats
from kvbm.block_pool import KVEvent
from kvbm.protocol import ExtraKeys, Sampling


class KVSource(Protocol):
    """Where an imported request's prompt KV comes from (a disaggregated prefill's pull).
    The engine allocates the prompt's blocks when it has room, then runs :meth:`load` on
    a loader thread while the request waits in the loading state."""

    deadline: float  # time.monotonic(): still waiting for blocks then fails the import

    def load(self, block_ids: list[int]) -> None:
        """Fill ``block_ids`` (the prompt's blocks, in order) with its KV; raise on failure."""

    def failed(self, why: str) -> None:
        """The import will not happen (engine thread); the request is dropped silently."""


@dataclass(slots=True)
class ImportedPrefill:
    """Decode side of disaggregation: the prompt's first token was sampled (and streamed)
    by the prefill worker, and its KV comes from ``source`` once the engine has blocks for
    it (``None`` only for an engine whose own connector brings the KV: vLLM's)."""

    first_token: int
    emitted_chars: int  # characters of text the prefill worker already released
    source: KVSource | None = None
    cached_tokens: int = 0  # prompt tokens the prefill worker found cached (for usage)


@dataclass(slots=True)
class ResumedOutput:
    """A request continued here after the worker streaming it died (migration): these
    output tokens are out already (their KV is recomputed with the prompt's), and
    ``emitted_chars`` characters of their text were sent."""

    output_token_ids: list[int]
    emitted_chars: int


@dataclass(slots=True)
class MMInput:
    """An image's embeddings in a prompt: they stand in for the token embeddings of the
    prompt's rows ``offset:offset + len(embeds)`` (the image's placeholder tokens)."""

    offset: int  # index in the prompt of the image's first placeholder token
    embeds: object  # a torch.Tensor [num_tokens, hidden] (this module stays torch-free)
    # an engine with a vision tower of its own (vLLM) may take the image itself instead
    # (``embeds`` None), and names it by its content hash (its uuid in vLLM's KV events)
    image: object = None  # a PIL image
    image_hash: str | None = None
    num_tokens: int = 0  # its placeholder tokens


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: Sampling
    prefill_only: bool = False  # stop after the first token and pin the prompt's blocks
    forced_first_token: int | None = None  # re-prefill: keep the token already streamed
    imported: ImportedPrefill | None = None
    block_extra_keys: list[ExtraKeys] | None = None  # per block: what else names it
    # images' embeddings at their placeholder positions; the caller names each image in the
    # blocks it covers (block_extra_keys: kvbm.protocol.image_extra_key of its hash)
    mm_inputs: list[MMInput] | None = None
    resumed: ResumedOutput | None = None
    # vLLM's KV connector (P/D), on a decode request: the prefill output's
    # ``kv_transfer_params`` ({"vllm": vLLM's own, "seed": the sampling seed both use})
    kv_transfer_params: dict | None = None
    # a later choice of an n > 1 request (workers.choices): the id of its first choice,
    # whose prompt it shares once computed (blocks, and the logits of its first token)
    fork_of: str | None = None
    priority: int = 0  # vLLM's: lower values are scheduled first (workers.scheduler)
    lora: LoraRef | None = None  # the LoRA adapter it runs through (its blocks' namespace)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    error_param: str | None = None  # the request field a refusal names
    # one kvbm.protocol.Logprob per token id, when the request asked for logprobs; the
    # prompt's (first output only), when it asked for prompt logprobs
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    embedding: str | None = None  # an embedding request's vector (kvbm.protocol.Pooling)
    prefilled: bool = False  # prefill-only request done; its blocks are pinned
    kv_block_ids: list[int] | None = None
    kv_transfer_params: dict | None = None  # vLLM prefill: where its connector keeps the KV
    timing: EngineTiming | None = None  # a finished request's, where the engine keeps it
    # a finished request's predicted-output drafts (accepted, rejected), where it drafted
    prediction: tuple[int, int] | None = None


@dataclass(slots=True)
class EngineTiming:
    """How a finished request went through the engine (its trace's stage span)."""

    queued_s: float | None = None  # arrival to its first step (vLLM's time_in_queue)
    first_token_s: float | None = None  # arrival to its first output token
    preemptions: int = 0


def failed(
    request_id: str, num_prompt_tokens: int, message: str, code: str | None = None,
    param: str | None = None,
) -> RequestOutput:  # fmt: skip
    """The output of a request that can never run (``code``: why, when it is the request's
    fault: kvbm.protocol.REQUEST_ERROR_CODES; ``param``: the field at fault)."""
    return RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                         num_prompt_tokens=num_prompt_tokens, error=message,
                         error_code=code, error_param=param)  # fmt: skip


def aborted(request_id: str, num_prompt_tokens: int) -> RequestOutput:
    """The output of a request aborted before it produced anything (held, queued)."""
    return RequestOutput(request_id, [], "", finished=True, finish_reason="abort",
                         num_prompt_tokens=num_prompt_tokens)  # fmt: skip


# The sampling features an engine may or may not serve: the request field that asks for
# one (as the API names it) -> whether a request's parameters use it. An engine lists those
# it serves (``supports``); a request using another is refused, naming the field.
FEATURES: dict[str, Callable[[Sampling], bool]] = {
    "n": lambda p: p.n > 1,
    "logprobs": lambda p: p.logprobs is not None,
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "logit_bias": lambda p: bool(p.logit_bias),
    "min_p": lambda p: p.min_p > 0.0,
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "bad_words": lambda p: bool(p.bad_words),
    "include_stop_str_in_output": lambda p: p.include_stop_str_in_output,
    "structured_outputs": lambda p: p.structured is not None and not p.structured.best_effort,
    "thinking_token_budget": lambda p: p.thinking is not None,
}


def refuse_unsupported(
    request_id: str, num_prompt_tokens: int, params: Sampling, engine: str,
    supports: frozenset[str],
) -> RequestOutput | None:  # fmt: skip
    """The failed output naming the first feature ``params`` use that this engine does not
    serve (``supports``: the names of FEATURES it does); ``None`` if it serves them all."""
    for name, used in FEATURES.items():
        if name not in supports and used(params):
            return failed(request_id, num_prompt_tokens,
                          f"the {engine} engine does not support {name}",
                          "unsupported_parameter", name)  # fmt: skip
    return None


def refuse_prompt(request_id: str, n: int, max_model_len: int) -> RequestOutput | None:
    """Every engine's first check of a prompt of ``n`` tokens: the failed output of an
    empty one or one that leaves no room to generate; ``None`` if it may run."""
    if n == 0:
        return failed(request_id, n, "prompt is empty")
    if n >= max_model_len:
        return failed(request_id, n, f"prompt has {n} tokens; the context window is "
                                     f"{max_model_len}")  # fmt: skip
    return None


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """An engine's configuration. The settings' fields have no default here: they are
    the engine and KVBM areas' (tasks/settings.py, where each is described), and one
    builder, ``tasks.settings.engine_config``, makes this from them (`conveyor worker`,
    tests and benches alike)."""

    # --- the engine area -----------------------------------------------------------------
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    dtype: str
    device: str
    kv_pin_timeout_s: float  # pinned prefill blocks nobody pulled are freed after
    enable_prefix_caching: bool
    max_loras: int  # LoRA adapters kept loaded (workers.lora.LoraCache)
    max_lora_rank: int
    # while sequences decode, a new prompt waits until this many times the last prefill
    # step's duration has passed since it arrived (vLLM's scheduler_delay_factor)
    scheduler_delay_factor: float
    stream_interval: int  # tokens per stream frame (workers.stream_interval), not the engine's
    decode_attention: str  # "kernel" (workers/paged_kernel.py), "torch" or "auto"
    # vLLM's --speculative-config (workers.spec_decode.SpecConfig; None: off)
    speculative_config: dict | None
    kernel_dir: str  # where the decode kernel is built and found
    # --- the KVBM area -------------------------------------------------------------------
    disk_dir: str | None  # G3's files
    disk_offload_filter: bool  # G3 admits a block once stored and hit twice
    # --- not settings: what the worker knows of its model and host ----------------------
    namespace: str = ""  # the served model name: kvbm.protocol.model_namespace of it
    enable_lora: bool = False  # the deployment serves LoRA adapters (vLLM must be told)
    record_kv_events: bool = True  # queue stored/removed events for the router's index
    # KVBM tiers below the engine pool (kvbm.offload), sized from the KVBM area's GB and
    # the model's block bytes: 0 blocks = tier off
    host_cache_blocks: int = 0  # G2, host memory
    disk_cache_blocks: int = 0  # G3, files under disk_dir


@dataclass(slots=True)
class StepCounts:
    """The latest computed step of an engine that schedules its own steps, updated in
    place every step (no allocation): the engine loop samples it with the step's wall time
    (:attr:`cluster.stats.EngineStats.step_samples`)."""

    step_no: int = 0  # the engine's step counter (0: no step yet)
    prefill_tokens: int = 0  # tokens computed in prompt chunks (a prompt, a recompute)
    decode_seqs: int = 0  # sequences decoding one token
    decode_kv_tokens: int = 0  # their KV context lengths, summed


@runtime_checkable
class Engine(Protocol):
    """What the engine loop and the engine process need of an engine. Every method runs on
    the engine loop's thread (:class:`workers.engine_loop.EngineLoop`)."""

    name: str  # what refusals call it: reference | mock | vllm
    supports: frozenset[str]  # the optional sampling features (FEATURES) it serves
    # the latest step's counts; None: the engine does not see its steps (vLLM's own loop)
    step_counts: StepCounts | None

    # --- requests -------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request (whole, prefill-and-hold, or decode-after-import, as ``req``
        says); a finished error output if it can never run."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is and free what it holds; ``None`` if unknown."""

    def step(self) -> list[RequestOutput]:
        """Compute one step; per-request outputs (a prefilled request's says ``prefilled``
        and names the blocks its KV is pinned in)."""

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (a step raised)."""

    @property
    def has_unfinished(self) -> bool:
        """Requests are waiting or running."""

    @property
    def stalled(self) -> bool:
        """Work waits but nothing fits until blocks come back."""

    @property
    def has_pinned(self) -> bool:
        """Prefilled KV waits for a decode worker (expire it now and then)."""

    # --- disaggregation: KV handed from a prefill engine to a decode engine ----------------
    # (the decode side imports it as a request's ImportedPrefill, through its KVSource)
    def release_pinned(self, request_id: str) -> bool:
        """Prefill side: the decode worker has the KV (or gave up); free its blocks."""

    def expire_pinned(self, now: float) -> list[str]:
        """Prefill side: free pinned KV nobody pulled in time; the requests it was for."""

    def kv_memory(self) -> object | None:
        """What a KV transfer backend moves blocks of (the reference engine's paged
        cache); ``None`` when this engine keeps no KV a backend could move."""

    # --- the router's index and metrics ----------------------------------------------------
    @property
    def records_kv_events(self) -> bool:
        """Whether :meth:`take_kv_events` reports cache changes."""

    def take_kv_events(self) -> list[KVEvent]:
        """Stored / removed block events since the last call."""

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached prefix (``reset_external``: the tiers below G1 too); False,
        nothing forgotten, while requests hold blocks."""

    def cached_block_hashes(self) -> list[int]:
        """Every block hash cached now in G1."""

    def cached_blocks_by_tier(self) -> dict[int, list[int]]:
        """Every block hash cached now, per tier (a snapshot to resync the router's index)."""

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """``waker`` is called from another thread when KV arrived or a copy ended: the
        engine loop should step (the engine never waits for a copy itself)."""

    def stats(self) -> EngineStats: ...
