"""An engine's counters as a worker reports them (:class:`EngineStats`).

The engine builds them (its scheduler's counts), the engine process adds its own (frames
published, KV events, transfers, images), the pipe carries them to the worker
(``workers.engine_ipc.Stats``), the heartbeat to Redis
(:class:`cluster.membership.HeartbeatReport`), and the API reads them back through the
same types for ``/metrics``.

On the wire they are flat JSON beside the report's own fields, as they always were: a
part the worker has not got (no KV transfer, no images, tiers off) is left out, and a
reader takes what it knows: a field an older worker does not send keeps its default, a
field it does not know (a newer worker's) is passed over.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

STEP_SAMPLES = 32  # the steps a heartbeat carries (EngineStats.step_samples)


# ======================================================================================
# The parts
# ======================================================================================
@dataclass(slots=True)
class TransferTotals:
    """One kind of transfer's totals (KV blocks or image embeddings) on one backend."""

    backend: str = ""
    bytes: int = 0
    seconds: float = 0.0
    count: int = 0
    failed: int = 0  # vLLM's connector counts its failed pulls; ours raise instead


@dataclass(slots=True)
class ImageCounters:
    """A vision-language worker's vision tower and embedding cache."""

    images_encoded: int = 0  # through the vision tower here
    encode_seconds: float = 0.0
    encode_batches: int = 0
    images_pulled: int = 0  # embeddings pulled from another worker
    pull_fallbacks: int = 0  # pulls that failed: encoded here instead
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0  # entries dropped to make room
    cache_entries: int = 0
    cache_bytes: int = 0  # bytes held now
    cache_max_bytes: int = 0


@dataclass(slots=True)
class KvbmCounters:
    """The KVBM tiers below the engine pool (``kvbm.offload.OffloadManager.report``):
    maps keyed by tier (``g1``..) or direction (``d2h``, ``h2d``, ``d2d``)."""

    matched_tokens: dict[str, int] = field(default_factory=dict)  # by the tier they came from
    lookup_blocks: int = 0  # missed in the pool, looked for in host memory
    host_hit_blocks: int = 0
    disk_lookup_blocks: int = 0
    disk_hit_blocks: int = 0
    offload_blocks: dict[str, int] = field(default_factory=dict)
    offload_bytes: dict[str, int] = field(default_factory=dict)
    onboard_blocks: dict[str, int] = field(default_factory=dict)
    onboard_bytes: dict[str, int] = field(default_factory=dict)
    onboard_failures: int = 0
    disk_write_errors: int = 0
    onboard_latency_buckets: list[float] = field(default_factory=list)  # upper bounds
    onboard_latency_counts: list[int] = field(default_factory=list)  # one more: +Inf
    onboard_latency_sum: float = 0.0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    host_blocks_pinned: int = 0
    disk_blocks_used: int = 0
    disk_blocks_total: int = 0
    disk_blocks_pinned: int = 0


# ======================================================================================
# The whole
# ======================================================================================
@dataclass(slots=True)
class EngineStats:
    """An engine's counters, and its engine process's, for the worker's heartbeat and
    the cluster's metrics. ``None``: the worker has no such part."""

    # --- the engine (workers.scheduler, workers.vllm_engine) ----------------------------
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    blocks_cached: int = 0
    blocks_pinned: int = 0  # prefilled requests whose KV awaits a pull
    prompt_tokens_seen: int = 0  # prefix-cache hit rate = cached / seen
    prompt_tokens_cached: int = 0
    # prompt tokens run through the model: a prefix-cache hit, an imported prefill or a
    # choice forked from its request's first choice (n > 1) computes none of its own
    prompt_tokens_computed: int = 0
    pins_expired: int = 0
    preemptions: int = 0
    steps: int = 0
    decode_tokens: int = 0  # tokens sampled (generated), every step's
    # per step, the KV context length of every decoding sequence, summed over the steps
    # (what attention reads: the planner's decode cost regression)
    decode_kv_tokens: int = 0
    loading: int = 0  # requests waiting for their KV (onboarding, a disagg pull)
    # speculative decoding (workers.spec_decode): sequences' steps with drafts, the draft
    # tokens, and those the model accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # KVBM tiers: occupancy, and the tiers' own report (None: tiers off)
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    disk_blocks_used: int = 0
    disk_blocks_total: int = 0
    kvbm: KvbmCounters | None = None
    vllm_unfinished: int | None = None  # vLLM's own count of the requests it holds
    # --- the engine process (workers.engine_proc, workers.encode_server) ----------------
    step_seconds: float = 0.0  # the engine loop's time in steps
    # how long the engine loop has been in its current round (a step under way); 0 while
    # it waits for work: the worker's watchdog reads it (workers.engine_proc.EngineClient)
    loop_busy_s: float = 0.0
    # the last <= STEP_SAMPLES steps, oldest first, each [step_no, wall_s, prefill_tokens,
    # decode_seqs, decode_kv_tokens] (step_no: the engine's step counter, so a reader
    # drops the samples it has seen); empty where the engine does not see its own steps
    step_samples: list[list[float]] = field(default_factory=list)
    frames_published: int = 0
    frame_publish_errors: int = 0
    kv_event_batches: int = 0
    kv_events: int = 0
    kv_event_resyncs: int = 0
    kv_event_errors: int = 0
    encode_requests: int | None = None  # an encode worker's requests
    kv_transfer: TransferTotals | None = None
    embedding_transfer: TransferTotals | None = None
    images: ImageCounters | None = None

    def to_json(self) -> dict[str, Any]:
        """The flat JSON mapping of the wire (parts the worker has not got left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineStats:
        """What :meth:`to_json` wrote, from any worker version (see the module's note);
        keys that are not counters (the report's own fields) are passed over."""
        st = _known(cls, d)
        st.kvbm = _part(KvbmCounters, d.get("kvbm"))
        st.kv_transfer = _part(TransferTotals, d.get("kv_transfer"))
        st.embedding_transfer = _part(TransferTotals, d.get("embedding_transfer"))
        st.images = _part(ImageCounters, d.get("images"))
        return st


_PARTS = frozenset({"kvbm", "kv_transfer", "embedding_transfer", "images"})


def _known(cls: type[T], d: dict[str, Any]) -> T:
    """``cls`` from the keys of ``d`` it has as plain fields (the rest passed over)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    return cls(**{k: d[k] for k in names if k in d and k not in _PARTS})


def _part(cls: type[T], d: Any) -> T | None:
    """One nested part (absent or empty: the worker has none)."""
    return _known(cls, d) if isinstance(d, dict) and d else None
