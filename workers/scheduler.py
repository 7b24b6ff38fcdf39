"""The continuous-batching scheduler: which sequences compute which tokens each step, and
the KV blocks they hold. No model, no torch.

Each step schedules running sequences first (one decode token each, or the next chunk of a
prefill), then admits waiting ones while the token budget, the sequence cap and free KV
blocks allow; when a running sequence cannot get a block, the most recently admitted one
is preempted (its blocks freed, recomputed later): vLLM's recompute policy. A new or
preempted sequence starts on the cached blocks of its longest cached prefix.

For disaggregation the scheduler also keeps a prefilled request's blocks pinned until a
decode worker has pulled them (or a timeout), and, on the decode side, blocks reserved
for KV being pulled.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvbm.block_pool import KVCacheManager, KVEvent
from kvbm.protocol import ExtraKeys, model_namespace
from workers.detokenizer import IncrementalDetokenizer
from workers.engine_api import EngineConfig, EngineRequest, EngineStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Seq:
    """A request's state inside the engine."""

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


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=model_namespace(config.namespace),
            record_events=config.enable_prefix_caching and config.record_kv_events,
        )
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.pinned: dict[str, float] = {}  # prefilled request -> deadline (monotonic)
        self.reserved: set[str] = set()  # decode side: blocks taken, KV being pulled
        self.reserved_aborted: set[str] = set()  # aborted mid-pull: freed once it ends
        self.prompt_tokens_seen = 0
        self.prompt_tokens_cached = 0
        self.num_pin_expired = 0
        self.num_preemptions = 0
        self.last_prefill_s = 0.0  # duration of the last step that ran a prompt chunk

    # ----------------------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return any(s.id == request_id for s in (*self.running, *self.waiting))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Seq, int]]:
        """This step's work: ``(sequence, tokens to compute)`` pairs, blocks allocated."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while self.kv.allocate_slots(seq.id, seq.num_computed + n) is None:
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
                hit = self.kv.find_prefix(seq.id, seq.token_ids, seq.req.block_extra_keys)
                seq.num_computed = hit
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self.kv.allocate_slots(seq.id, seq.num_computed + n) is None:
                if hit:  # give the cached blocks back until there is room
                    self.kv.free(seq.id)
                    seq.num_computed = 0
                break
            if seq.num_preemptions == 0 and seq.req.imported is None:
                seq.num_cached = min(hit, seq.num_prompt)  # a resumed one: its prompt's
                self.prompt_tokens_seen += seq.num_prompt
                self.prompt_tokens_cached += seq.num_cached
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def computed(self, seq: Seq, end: int) -> None:
        """``seq``'s tokens up to ``end`` are computed: name its full blocks."""
        seq.num_computed = end
        self.kv.cache_blocks(seq.id, seq.token_ids, end)

    def finish(self, seq: Seq) -> None:
        """``seq`` is done: it leaves the batch and its blocks are freed."""
        self.running.remove(seq)
        self.kv.free(seq.id)

    def pin(self, seq: Seq) -> list[int]:
        """``seq`` is prefilled: it leaves the batch, its blocks stay for a decode worker
        to pull until released or ``kv_pin_timeout_s`` passes. Returns the blocks."""
        self.running.remove(seq)
        self.pinned[seq.id] = time.monotonic() + self.config.kv_pin_timeout_s
        return list(self.kv.block_table(seq.id))

    def remove(self, request_id: str) -> Seq | None:
        """Take a request out of the queues and free its blocks; ``None`` if not there."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.id == request_id:
                    queue.remove(seq)
                    self.kv.free(seq.id)
                    return seq
        return None

    def remove_all(self) -> list[Seq]:
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self.kv.free(seq.id)
        self.running.clear()
        self.waiting.clear()
        return seqs

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    # --- disaggregation -------------------------------------------------------------------
    def reserve(
        self, request_id: str, num_tokens: int, extra_keys: list[ExtraKeys] | None = None
    ) -> list[int] | None:
        alloc = self.kv.allocate_slots(request_id, num_tokens, extra_keys)
        if alloc is None:
            return None
        self.reserved.add(request_id)
        return list(alloc.block_ids)

    def take_reservation(self, request_id: str) -> bool:
        """The imported request is starting: its reservation becomes its blocks. False if
        it was aborted while its KV was being pulled (the blocks are freed then)."""
        assert request_id in self.reserved, "imported KV without a reservation"
        if request_id in self.reserved_aborted:
            self.cancel_reservation(request_id)
            return False
        self.reserved.discard(request_id)
        return True

    def cancel_reservation(self, request_id: str) -> None:
        self.reserved_aborted.discard(request_id)
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.kv.free(request_id)

    def abort_reservation(self, request_id: str) -> bool:
        """An abort for a request whose KV is being pulled: its blocks are freed only when
        the pull ends, since the transfer may still be writing into them."""
        if request_id not in self.reserved:
            return False
        self.reserved_aborted.add(request_id)
        return True

    def release_pinned(self, request_id: str) -> bool:
        if self.pinned.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def expire_pinned(self, now: float) -> list[str]:
        gone = [rid for rid, deadline in self.pinned.items() if deadline <= now]
        for rid in gone:
            self.release_pinned(rid)
            self.num_pin_expired += 1
            log.warning("[%s] pinned KV not pulled in %.0fs: freed", rid,
                        self.config.kv_pin_timeout_s)  # fmt: skip
        return gone

    # --- the router's index and metrics ---------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def stats(self, steps: int) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            blocks_used=pool.num_used,
            blocks_total=pool.num_blocks,
            blocks_cached=pool.num_cached,
            blocks_pinned=len(self.pinned),
            prompt_tokens_seen=self.prompt_tokens_seen,
            prompt_tokens_cached=self.prompt_tokens_cached,
            pins_expired=self.num_pin_expired,
            preemptions=self.num_preemptions,
            steps=steps,
        )

    # ----------------------------------------------------------------------------------
    def _admit_now(self) -> bool:
        """Whether waiting prompts may start this step (see ``scheduler_delay_factor``)."""
        factor = self.config.scheduler_delay_factor
        if factor <= 0 or not self.running or not self.waiting:
            return True
        oldest = min(seq.arrival for seq in self.waiting)
        return time.monotonic() - oldest >= factor * self.last_prefill_s

    def _preempt(self, seq: Seq) -> None:
        self.kv.free(seq.id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (recompute %d tokens)", seq.id, seq.num_tokens)
