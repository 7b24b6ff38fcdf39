"""The engine core: a :class:`workers.engine_api.Engine` whose steps a subclass computes.

``EngineCore`` puts a :class:`workers.scheduler.Scheduler` (batching, KV blocks, pins)
and an :class:`workers.output_processor.OutputProcessor` (stop rules, outputs) together and
implements the whole engine protocol; what a step computes is a subclass's business:
:class:`workers.engine.Engine` runs the Llama forward pass and samples;
:class:`workers.mock_engine.MockEngine` sleeps as long as a GPU would and emits
placeholder tokens. Both therefore share one scheduler, one block pool and one stream of
KV events, and the KVBM tiers below the pool (:meth:`EngineCore._attach_tiers`: each
brings its own copier, real bytes or simulated time). This module does not import torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from kvbm.block_pool import KVEvent
from kvbm.disk import BlockLayout, BlockStore, FileBlockStore, claim_dir
from kvbm.offload import BlockCopier, OffloadManager
from kvbm.protocol import ExtraKeys, Sampling, model_namespace
from workers.detokenizer import IncrementalDetokenizer
from workers.engine_api import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    RequestOutput,
    failed,
    refuse_prompt,
    refuse_unsupported,
)
from workers.output_processor import OutputProcessor, finished
from workers.scheduler import Scheduler, Seq

log = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + output processing; subclasses compute the steps (``_forward``)."""

    name = "core"  # what refusals call this engine
    # the optional sampling features (workers.engine_api.FEATURES) this engine serves
    supports: frozenset[str] = frozenset()

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
        self.scheduler = Scheduler(config)
        self.outputs = OutputProcessor(eos_token_ids, max_model_len)
        self.num_steps = 0
        self._stalled = False
        self._disk_lock: int | None = None  # held while this engine uses its disk dir

    # --- what a subclass provides ---------------------------------------------------------
    def _make_generator(self, params: Sampling) -> object | None:
        """The request's random source (``None``: greedy, or the engine needs none)."""
        return None

    def _forward(self, batch: list[tuple[Seq, int, int]], sampled: list[Seq]) -> list[int]:
        """Compute tokens ``start:end`` of every ``(seq, start, end)`` in ``batch`` (their KV
        goes into the sequences' blocks) and return one sampled token per ``sampled``
        sequence (those whose computed tokens reach their end), in order."""
        raise NotImplementedError

    def kv_memory(self) -> object | None:
        return None

    def _attach_tiers(self, copier: BlockCopier, layout: BlockLayout,
                      disk: BlockStore | None = None) -> None:  # fmt: skip
        """Set up the KVBM tiers the config asks for (none: nothing to do). ``disk``: the
        G3 store to use; by default files in a slot of ``config.disk_dir`` this process
        holds (:func:`kvbm.disk.claim_dir`), whose valid blocks it takes over."""
        c = self.config
        if not c.enable_prefix_caching or not (c.host_cache_blocks or c.disk_cache_blocks):
            return
        if c.disk_cache_blocks and disk is None:
            if not c.disk_dir:
                raise ValueError("disk_cache_blocks > 0 needs a disk_dir")
            d, self._disk_lock = claim_dir(Path(c.disk_dir), model_namespace(c.namespace))
            disk = FileBlockStore(d, layout)
            log.info("KV disk tier: %d blocks in %s", c.disk_cache_blocks, d)
        off = OffloadManager(self.scheduler.kv.pool, copier, c.block_size, layout.block_bytes,
                             host_blocks=c.host_cache_blocks, disk=disk,
                             disk_blocks=c.disk_cache_blocks,
                             disk_filter=c.disk_offload_filter,
                             record_events=self.records_kv_events)  # fmt: skip
        self.scheduler.attach_offload(off)

    def close(self) -> None:
        """Stop the tiers' copy threads and let go of the disk dir."""
        self.scheduler.close()
        if self._disk_lock is not None:
            os.close(self._disk_lock)
            self._disk_lock = None

    # --- the engine protocol --------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def stalled(self) -> bool:
        return self._stalled

    @property
    def has_pinned(self) -> bool:
        return bool(self.scheduler.pinned)

    @property
    def records_kv_events(self) -> bool:
        return self.scheduler.kv.pool.records_events

    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        rid = req.request_id
        if self.scheduler.has(rid):
            # a second copy must not take the first one's blocks (or fail the whole step)
            log.warning("[%s] is already running: the second copy is dropped", rid)
            return None
        n = len(req.prompt_token_ids)
        if (refused := refuse_prompt(rid, n, self.max_model_len)) is not None:
            return refused
        if (refused := refuse_unsupported(rid, n, req.params, self.name,
                                          self.supports)) is not None:  # fmt: skip
            return refused
        detok = IncrementalDetokenizer(self.tokenizer, req.params.stop,
                                       req.params.skip_special_tokens,
                                       req.params.include_stop_str_in_output)  # fmt: skip
        seq = Seq(req, detok, self._make_generator(req.params), list(req.prompt_token_ids), n)
        if req.imported is not None:
            if req.imported.source is None:
                if not self.scheduler.take_reservation(rid):  # cancelled while pulling
                    return finished(seq, [], "", "abort")
                seq.num_computed = n  # the prompt's KV is in the reserved blocks
                seq.matched = True
            first = req.imported.first_token
            seq.num_cached = req.imported.cached_tokens
            seq.token_ids.append(first)
            seq.output_ids.append(first)
            detok.prime([first], req.imported.emitted_chars)
        elif req.resumed is not None:
            # the tokens out so far join the prompt's in the first forward (as a preempted
            # request's do), and count as output: max_tokens, min_tokens, per-index seeds
            # and usage go on from there
            out = list(req.resumed.output_token_ids)
            if n + len(out) >= self.max_model_len or len(out) >= req.params.max_tokens:
                return failed(rid, n, f"cannot resume after {len(out)} output tokens: the "
                                      "request was already complete")  # fmt: skip
            seq.token_ids.extend(out)
            seq.output_ids.extend(out)
            detok.prime(out, req.resumed.emitted_chars)
        self.scheduler.add(seq)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.scheduler.abort_reservation(request_id):
            return None
        self.scheduler.release_pinned(request_id)
        seq = self.scheduler.remove(request_id)
        return None if seq is None else finished(seq, [], "", "abort")

    def step(self) -> list[RequestOutput]:
        """Schedule, compute one step, and report per-request outputs."""
        scheduled = self.scheduler.schedule()
        # requests aborted while their KV was loading end once the copy has ended
        dropped = [finished(seq, [], "", "abort") for seq in self.scheduler.take_dropped()]
        self._stalled = not scheduled and self.has_unfinished
        if not scheduled:
            return dropped
        self.num_steps += 1
        batch = [(seq, seq.num_computed, seq.num_computed + n) for seq, n in scheduled]
        sampled = [seq for seq, _, end in batch if end == seq.num_tokens]
        t0 = time.monotonic()
        tokens = self._forward(batch, sampled)
        if any(n > 1 for _, n in scheduled):
            self.scheduler.last_prefill_s = time.monotonic() - t0
        for seq, _, end in batch:
            self.scheduler.computed(seq, end)
        self.scheduler.flush()  # the blocks this step named go down, in one copy
        outputs: list[RequestOutput] = dropped
        for seq, tok in zip(sampled, tokens, strict=True):
            forced = seq.req.forced_first_token
            if forced is not None and not seq.output_ids:
                tok = forced
            verdict = self.outputs.append(seq, tok)
            out = verdict.output
            if verdict.finished:
                self.scheduler.finish(seq)
            elif seq.req.prefill_only:
                # prefill done: keep the prompt's blocks for the decode worker to pull
                out.prefilled = True
                out.kv_block_ids = self.scheduler.pin(seq)
            outputs.append(out)
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for seq in self.scheduler.remove_all():
            out = finished(seq, [], seq.detok.finish(), "error")
            out.error = message
            outs.append(out)
        return outs

    def reserve(
        self, request_id: str, num_tokens: int, extra_keys: list[ExtraKeys] | None = None
    ) -> list[int] | None:
        return self.scheduler.reserve(request_id, num_tokens, extra_keys)

    def cancel_reservation(self, request_id: str) -> None:
        self.scheduler.cancel_reservation(request_id)

    def release_pinned(self, request_id: str) -> bool:
        return self.scheduler.release_pinned(request_id)

    def expire_pinned(self, now: float) -> list[str]:
        return self.scheduler.expire_pinned(now)

    def take_kv_events(self) -> list[KVEvent]:
        return self.scheduler.take_events()

    def cached_block_hashes(self) -> list[int]:
        return self.scheduler.kv.pool.cached_hashes()

    def cached_blocks_by_tier(self) -> dict[int, list[int]]:
        return self.scheduler.cached_by_tier()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self.scheduler.set_waker(waker)

    def stats(self) -> EngineStats:
        return self.scheduler.stats(self.num_steps)

    # ----------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    return (seed * 1_000_003 + index * 7919 + 0x9E3779B9) % (2**63 - 1)
