"""The engine core: continuous-batching scheduler and block accounting, no model.

Each step schedules running sequences first (one decode token each, or the next chunk of a
prefill), then admits waiting ones while the token budget, the sequence cap and free KV
blocks allow; when a running sequence cannot get a block, the most recently admitted one
is preempted (its blocks freed, recomputed later) — vLLM's recompute policy. A new or
preempted sequence starts on the cached blocks of its longest cached prefix.

``EngineCore`` does all of that and the per-token post-processing (detokenization, stop
rules, finish reasons, pinning prefilled blocks for disaggregation). What a step computes
is a subclass's business: :class:`workers.engine.Engine` runs the Llama forward pass and
samples; :class:`workers.mock_engine.MockEngine` sleeps as long as a GPU would and emits
placeholder tokens. Both therefore share one scheduler, one block pool and one stream of
KV events. This module does not import torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from kvbm.block_pool import KVCacheManager, KVEvent
from kvbm.hashing import namespace_hash
from workers.detokenizer import IncrementalDetokenizer
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ImportedPrefill:
    """Decode side of disaggregation: the prompt's KV is already in the request's reserved
    blocks and its first token was sampled (and streamed) by the prefill worker."""

    first_token: int
    emitted_chars: int  # characters of text the prefill worker already released


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False  # stop after the first token and pin the prompt's blocks
    forced_first_token: int | None = None  # re-prefill: keep the token already streamed
    imported: ImportedPrefill | None = None


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
    prefilled: bool = False  # prefill-only request done; its blocks are pinned
    kv_block_ids: list[int] | None = None


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_pin_timeout_s: float = 60.0  # pinned prefill blocks nobody pulled are freed after
    enable_prefix_caching: bool = True
    namespace: str = ""  # folded into block hashes (model id); same on every worker
    record_kv_events: bool = True  # queue stored/removed events for the router's index
    # while sequences decode, a new prompt waits until this many times the last prefill
    # step's duration has passed since it arrived (vLLM's scheduler_delay_factor): prompts
    # arriving close together share a step, and fewer decode steps stall on one. 0: at once
    scheduler_delay_factor: float = 0.0
    # decode attention: "kernel" (the C kernel that reads KV blocks in place; float32 on
    # CPU), "torch" (gather the blocks, then SDPA) or "auto" (the kernel where it builds)
    decode_attention: str = "auto"


@dataclass(slots=True)
class _Seq:
    req: EngineRequest
    detok: IncrementalDetokenizer
    generator: object | None  # the engine's random source (torch.Generator)
    token_ids: list[int]  # prompt + output
    num_prompt: int
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at first admission
    arrival: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class EngineCore:
    """Scheduler + KV block accounting + post-processing; subclasses compute the steps."""

    def __init__(
        self, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int,
        eos_token_ids: list[int] | tuple[int, ...],
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        bs = config.block_size
        if config.num_kv_blocks * bs < self.max_model_len:
            raise ValueError(
                f"KV pool of {config.num_kv_blocks} blocks x {bs} tokens cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; raise num_kv_blocks"
            )
        self.kv_manager = KVCacheManager(
            config.num_kv_blocks,
            bs,
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=namespace_hash(config.namespace) if config.namespace else 0,
            record_events=config.enable_prefix_caching and config.record_kv_events,
        )
        self.prompt_tokens_seen = 0  # prefix-cache hit rate = cached / seen
        self.prompt_tokens_cached = 0
        self.eos_ids = set(eos_token_ids)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.pinned: dict[str, float] = {}  # prefilled request -> deadline (monotonic)
        self.reserved: set[str] = set()  # decode side: blocks taken, KV being pulled
        self.reserved_aborted: set[str] = set()  # aborted mid-pull: freed once it ends
        self.num_pin_expired = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.stalled = False  # work waits but nothing fits (blocks pinned or reserved)
        self.last_prefill_s = 0.0  # duration of the last step that ran a prompt chunk

    # --- what a subclass provides ---------------------------------------------------------
    def _make_generator(self, params: SamplingParams) -> object | None:
        """The request's random source (``None``: greedy, or the engine needs none)."""
        return None

    def _forward(self, batch: list[tuple[_Seq, int, int]], sampled: list[_Seq]) -> list[int]:
        """Compute tokens ``start:end`` of every ``(seq, start, end)`` in ``batch`` (their KV
        goes into the sequences' blocks) and return one sampled token per ``sampled``
        sequence (those whose computed tokens reach their end), in order."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request. Returns a finished error output if it can never run."""
        rid = req.request_id
        if any(s.id == rid for s in (*self.running, *self.waiting)):
            # a second copy must not take the first one's blocks (or fail the whole step)
            log.warning("[%s] is already running: the second copy is dropped", rid)
            return None
        n = len(req.prompt_token_ids)
        if n == 0:
            return self._error(req, "prompt is empty")
        if n >= self.max_model_len:
            return self._error(
                req, f"prompt has {n} tokens; the context window is {self.max_model_len}"
            )
        gen = self._make_generator(req.params)
        detok = IncrementalDetokenizer(
            self.tokenizer, req.params.stop, req.params.skip_special_tokens
        )
        seq = _Seq(req, detok, gen, list(req.prompt_token_ids), n)
        if req.imported is not None:
            assert req.request_id in self.reserved, "imported KV without a reservation"
            if req.request_id in self.reserved_aborted:  # cancelled while pulling
                self.cancel_reservation(req.request_id)
                return self._finish_output(seq, [], "", "abort", None)
            self.reserved.discard(req.request_id)
            first = req.imported.first_token
            seq.token_ids.append(first)
            seq.output_ids.append(first)
            seq.num_computed = n  # the prompt's KV is in the reserved blocks
            detok.prime([first], req.imported.emitted_chars)
        self.waiting.append(seq)
        return None

    # ----------------------------------------------------------------------------------
    # Disaggregation: pinned prefill blocks, decode-side reservations
    # ----------------------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode side: take blocks for ``num_tokens`` of imported KV (``None``: no room)."""
        alloc = self.kv_manager.allocate_slots(request_id, num_tokens)
        if alloc is None:
            return None
        self.reserved.add(request_id)
        return list(alloc.block_ids)

    def cancel_reservation(self, request_id: str) -> None:
        """The pull failed or was abandoned: free the reserved blocks."""
        self.reserved_aborted.discard(request_id)
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.kv_manager.free(request_id)

    def release_pinned(self, request_id: str) -> bool:
        """Prefill side: the decode worker has the blocks (or gave up); free them."""
        if self.pinned.pop(request_id, None) is None:
            return False
        self.kv_manager.free(request_id)
        return True

    def expire_pinned(self, now: float) -> list[str]:
        """Free pinned blocks whose decode never pulled them; returns their requests."""
        gone = [rid for rid, deadline in self.pinned.items() if deadline <= now]
        for rid in gone:
            self.release_pinned(rid)
            self.num_pin_expired += 1
            log.warning("[%s] pinned KV not pulled in %.0fs: freed", rid,
                        self.config.kv_pin_timeout_s)  # fmt: skip
        return gone

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is and free its blocks; ``None`` if unknown.

        Blocks reserved for a pull still in flight are freed only when the pull ends
        (``add_request`` or ``cancel_reservation``): freeing them now could hand them to
        another sequence while the transfer is still writing into them."""
        if request_id in self.reserved:
            self.reserved_aborted.add(request_id)
            return None
        self.release_pinned(request_id)
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.id == request_id:
                    queue.remove(seq)
                    self.kv_manager.free(seq.id)
                    return self._finish_output(seq, [], "", "abort", None)
        return None

    def step(self) -> list[RequestOutput]:
        """Schedule, compute one step, and report per-request outputs."""
        scheduled = self._schedule()
        self.stalled = not scheduled and self.has_unfinished
        if not scheduled:
            return []
        self.num_steps += 1
        batch = [(seq, seq.num_computed, seq.num_computed + n) for seq, n in scheduled]
        sampled = [seq for seq, _, end in batch if end == seq.num_tokens]
        t0 = time.monotonic()
        tokens = self._forward(batch, sampled)
        if any(n > 1 for _, n in scheduled):
            self.last_prefill_s = time.monotonic() - t0
        for seq, _, end in batch:
            seq.num_computed = end
            self.kv_manager.cache_blocks(seq.id, seq.token_ids, end)
        outputs: list[RequestOutput] = []
        for seq, tok in zip(sampled, tokens, strict=True):
            forced = seq.req.forced_first_token
            if forced is not None and not seq.output_ids:
                tok = forced
            outputs.append(self._append(seq, tok))
        return outputs

    def take_kv_events(self) -> list[KVEvent]:
        """Stored / removed block events since the last call (for the router's index)."""
        return self.kv_manager.pool.take_events()

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (used when a step raised)."""
        outs = []
        for seq in [*self.running, *self.waiting]:
            self.kv_manager.free(seq.id)
            out = self._finish_output(seq, [], seq.detok.finish(), "error", None)
            out.error = message
            outs.append(out)
        self.running.clear()
        self.waiting.clear()
        return outs

    # ----------------------------------------------------------------------------------
    # Scheduling
    # ----------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[_Seq, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while self.kv_manager.allocate_slots(seq.id, seq.num_computed + n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: it was the last running one
        if preempted or not self._admit_now():
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = 0
            if seq.num_computed == 0:  # new or preempted: start on its cached prefix
                hit = self.kv_manager.find_prefix(seq.id, seq.token_ids)
                seq.num_computed = hit
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self.kv_manager.allocate_slots(seq.id, seq.num_computed + n) is None:
                if hit:  # give the cached blocks back until there is room
                    self.kv_manager.free(seq.id)
                    seq.num_computed = 0
                break
            if seq.num_preemptions == 0 and seq.req.imported is None:
                seq.num_cached = hit
                self.prompt_tokens_seen += seq.num_prompt
                self.prompt_tokens_cached += hit
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _admit_now(self) -> bool:
        """Whether waiting prompts may start this step (see ``scheduler_delay_factor``)."""
        factor = self.config.scheduler_delay_factor
        if factor <= 0 or not self.running or not self.waiting:
            return True
        oldest = min(seq.arrival for seq in self.waiting)
        return time.monotonic() - oldest >= factor * self.last_prefill_s

    def _preempt(self, seq: _Seq) -> None:
        self.kv_manager.free(seq.id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (recompute %d tokens)", seq.id, seq.num_tokens)

    # ----------------------------------------------------------------------------------
    # Post-processing
    # ----------------------------------------------------------------------------------
    def _banned(self, seq: _Seq) -> list[int]:
        p = seq.req.params
        if len(seq.output_ids) >= p.min_tokens:
            return []
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))

    def _append(self, seq: _Seq, tok: int) -> RequestOutput:
        p = seq.req.params
        seq.token_ids.append(tok)
        seq.output_ids.append(tok)
        n_out = len(seq.output_ids)
        step = seq.detok.step(tok, check_stop=n_out >= p.min_tokens)
        reason: str | None = None
        stop_reason: str | int | None = None
        if step.stop is not None:
            reason, stop_reason = "stop", step.stop
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = "stop", tok
        elif tok in self.eos_ids and not p.ignore_eos and n_out >= p.min_tokens:
            reason = "stop"
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            out = RequestOutput(
                seq.id,
                [tok],
                step.text,
                num_prompt_tokens=seq.num_prompt,
                num_output_tokens=n_out,
                num_cached_tokens=seq.num_cached,
            )
            if seq.req.prefill_only:
                # prefill done: keep the prompt's blocks for the decode worker to pull
                self.running.remove(seq)
                self.pinned[seq.id] = time.monotonic() + self.config.kv_pin_timeout_s
                out.prefilled = True
                out.kv_block_ids = list(self.kv_manager.block_table(seq.id))
            return out
        self.running.remove(seq)
        self.kv_manager.free(seq.id)
        tail = "" if step.stop is not None else seq.detok.finish()
        return self._finish_output(seq, [tok], step.text + tail, reason, stop_reason)

    def _finish_output(
        self,
        seq: _Seq,
        toks: list[int],
        text: str,
        reason: str,
        stop_reason: str | int | None,
    ) -> RequestOutput:
        return RequestOutput(
            seq.id,
            toks,
            text,
            finished=True,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_cached,
        )

    def _error(self, req: EngineRequest, message: str) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            [],
            "",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=len(req.prompt_token_ids),
            error=message,
        )


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    return (seed * 1_000_003 + index * 7919 + 0x9E3779B9) % (2**63 - 1)
