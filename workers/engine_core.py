"""The engine core: a :class:`workers.engine_api.Engine` whose steps a subclass computes.

``EngineCore`` puts a :class:`workers.scheduler.Scheduler` (batching, KV blocks, pins)
and an :class:`workers.output_processor.OutputProcessor` (stop rules, outputs) together and
implements the whole engine protocol; what a step computes is a subclass's business:
:class:`workers.engine.Engine` runs the Llama forward pass and samples;
:class:`workers.mock_engine.MockEngine` sleeps as long as a GPU would and emits
placeholder tokens. Both therefore share one scheduler, one block pool and one stream of
KV events, and the KVBM tiers below the pool (:meth:`EngineCore._attach_tiers`: each
brings its own copier, real bytes or simulated time). This module does not import torch.

A request of ``n`` choices arrives as ``n`` requests (:mod:`workers.choices`); its later
choices fork from its first as the prompt completes (the scheduler shares the prompt's
blocks), each sampling its first token from the first choice's logits (``_with_forks``)
with its own generator; a subclass copies a forked partial block's KV (``_copy_blocks``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from cluster.stats import EngineStats
from kvbm.block_pool import KVEvent
from kvbm.disk import BlockLayout, BlockStore, FileBlockStore, claim_dir
from kvbm.offload import BlockCopier, OffloadManager
from kvbm.protocol import Sampling, model_namespace
from workers.detokenizer import IncrementalDetokenizer
from workers.engine_api import (
    EngineConfig,
    EngineRequest,
    RequestOutput,
    StepCounts,
    aborted,
    failed,
    refuse_prompt,
    refuse_unsupported,
)
from workers.output_processor import OutputProcessor, Verdict, finished, timing_of
from workers.scheduler import Scheduler, Seq
from workers.spec_decode import (
    PREDICTION_DRAFT_TOKENS,
    NgramIndex,
    PredictionTracker,
    SpecConfig,
    SpecStats,
    accepted,
    eligible,
)

if TYPE_CHECKING:
    from workers.structured import Constraint, StructuredOutputs

log = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + output processing; subclasses compute the steps (``_forward``)."""

    name = "core"  # what refusals call this engine
    # the optional sampling features (workers.engine_api.FEATURES) this engine serves
    supports: frozenset[str] = frozenset({"n"})
    # whether _forward checks drafts (fills _spec_picks): speculative decoding is served
    speculates = False
    # grammars, matchers and masks of constrained requests, where the engine serves them
    structured: StructuredOutputs | None = None

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
        self._step = StepCounts()  # this step's counts, set before _forward
        self.step_counts: StepCounts | None = self._step
        self.decode_tokens = 0  # tokens sampled, all steps
        self.decode_kv_tokens = 0  # the decoding sequences' context lengths, all steps
        # this step's later choices sample from their first choice's row of logits: the
        # row of each sampled sequence (None: one row each, in order)
        self._fork_rows: list[int] | None = None
        self._ending_rows = 0  # of the step under way: the sequences whose tokens end in it
        self._stalled = False
        self._disk_lock: int | None = None  # held while this engine uses its disk dir
        # speculative decoding (workers.spec_decode): drafts of this step by sequence id,
        # and the model's picks at their rows (set by _forward)
        self.spec = SpecConfig.parse(config.speculative_config)
        if self.spec is not None and not self.speculates:
            log.warning("%s engine: speculative decoding is not served here; ignored",
                        self.name)  # fmt: skip
            self.spec = None
        self.spec_stats = SpecStats()
        self._drafts: dict[str, list[int]] = {}
        self._predicted: set[str] = set()  # of those, the ones drafted from a prediction
        self._spec_picks: dict[str, list[int]] = {}

    # --- what a subclass provides ---------------------------------------------------------
    def _make_generator(self, params: Sampling) -> object | None:
        """The request's random source (``None``: greedy, or the engine needs none)."""
        return None

    def _forward(self, batch: list[tuple[Seq, int, int]], sampled: list[Seq]) -> list[int]:
        """Compute tokens ``start:end`` of every ``(seq, start, end)`` in ``batch`` (their KV
        goes into the sequences' blocks) and return one sampled token per ``sampled``
        sequence (those whose computed tokens reach their end), in order."""
        raise NotImplementedError

    def _adapter(self, req: EngineRequest) -> object | None:
        """The weights of ``req``'s LoRA adapter, kept on its sequence while it runs
        (None: no adapter, or the engine computes none)."""
        return None

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of each ``(source, destination)`` block (a forked choice's partial
        last block: workers.scheduler.Scheduler.fork)."""

    def _with_forks(self, logits):
        """``logits`` (one row per sequence ending in this step's batch) with a row for
        each sampled sequence: a forked choice samples from its first choice's row."""
        return logits if self._fork_rows is None else logits[self._fork_rows]

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
        if self.structured is not None:
            self.structured.close()
        if self._disk_lock is not None:
            os.close(self._disk_lock)
            self._disk_lock = None

    # --- the engine protocol --------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.structured and self.structured.pending)

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
        if self.scheduler.has(rid) or (self.structured and self.structured.holds(rid)):
            # a second copy must not take the first one's blocks (or fail the whole step)
            log.warning("[%s] is already running: the second copy is dropped", rid)
            return None
        n = len(req.prompt_token_ids)
        if (refused := refuse_prompt(rid, n, self.max_model_len)) is not None:
            return refused
        if (refused := refuse_unsupported(rid, n, req.params, self.name,
                                          self.supports)) is not None:  # fmt: skip
            return refused
        if req.params.structured is None or self.structured is None:
            return self._start(req, None)
        constraint = self.structured.admit(req)
        if constraint is None:
            return None  # waits for its grammar to compile; a step starts it
        if isinstance(constraint, str):
            return self._unconstrained(req, constraint)
        return self._start(req, constraint)

    def _start(self, req: EngineRequest, constraint: Constraint | None) -> RequestOutput | None:
        """Put a request that passed the checks into the scheduler's queue."""
        rid, n = req.request_id, len(req.prompt_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, req.params.stop,
                                       req.params.skip_special_tokens,
                                       req.params.include_stop_str_in_output)  # fmt: skip
        seq = Seq(req, detok, self._make_generator(req.params), list(req.prompt_token_ids), n)
        seq.constraint = constraint
        seq.adapter = self._adapter(req)
        if req.fork_of is not None and self.scheduler.park(seq, req.fork_of):
            return None  # starts when its first choice has computed the prompt
        if req.imported is not None:
            assert req.imported.source is not None, \
                "an imported request names where its KV comes from (a KVSource)"  # fmt: skip
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
        if self.structured is not None and (req := self.structured.drop(request_id)):
            return aborted(request_id, len(req.prompt_token_ids))
        self.scheduler.release_pinned(request_id)
        seq = self.scheduler.remove(request_id)
        return None if seq is None else finished(seq, [], "", "abort")

    def step(self) -> list[RequestOutput]:
        """Schedule, compute one step, and report per-request outputs."""
        started = self._start_constrained() if self.structured is not None else []
        scheduled = self.scheduler.schedule()
        # requests aborted while their KV was loading end once the copy has ended
        dropped = started + [finished(seq, [], "", "abort")
                             for seq in self.scheduler.take_dropped()]  # fmt: skip
        self._stalled = not scheduled and self.has_unfinished
        if not scheduled:
            return dropped
        self.num_steps += 1
        batch = [(seq, seq.num_computed, seq.num_computed + n) for seq, n in scheduled]
        if self.spec is not None or (self.speculates and any(
                seq.req.params.prediction for seq, _, _ in batch)):  # fmt: skip
            batch = self._speculate(batch)
        sampled = [seq for seq, _, end in batch if end == seq.num_tokens]
        self._count_step(batch)
        self._ending_rows = len(sampled)  # the forward's logits rows: one per sequence ending
        # a request's later choices (n > 1) fork from its first as its prompt completes
        forks = self.scheduler.forks_due(sampled) if self.scheduler.parked else []
        if forks:
            row = {id(seq): i for i, seq in enumerate(sampled)}
            self._fork_rows = [*range(len(sampled)), *(row[id(p)] for p, _ in forks)]
            sampled += [child for _, child in forks]
        t0 = time.monotonic()
        try:
            tokens = self._forward(batch, sampled)
        except BaseException:
            for _, child in forks:  # not forked: fail_all ends them with the others
                self.scheduler.add(child)
            self._drop_drafts(batch)
            raise
        finally:
            self._fork_rows = None
        # a speculating sequence's (position of its last token, its tokens of this step)
        spoken: dict[str, tuple[int, list[int]]] = {}
        if self._drafts:
            batch, spoken = self._verify(batch, sampled, tokens)
        if any(n > 1 and seq.id not in spoken for seq, n in scheduled):
            self.scheduler.last_prefill_s = time.monotonic() - t0
        for seq, _, end in batch:
            self.scheduler.computed(seq, end)
        if forks:  # the prompt's KV is in (and its blocks named): share it
            pairs = [self.scheduler.fork(parent, child) for parent, child in forks]
            if copies := [p for p in pairs if p is not None]:
                self._copy_blocks(copies)
        self.scheduler.flush()  # the blocks this step named go down, in one copy
        self.decode_tokens += len(tokens) + sum(len(t) - 1 for _, t in spoken.values())
        outputs: list[RequestOutput] = dropped
        for seq, tok in zip(sampled, tokens, strict=True):
            forced = seq.req.forced_first_token
            if forced is not None and not seq.output_ids:
                tok = forced
            if seq.id in spoken:
                start, toks = spoken[seq.id]
                del seq.token_ids[start + 1 :]  # the accepted drafts go in again, as output
                verdict = self._append_all(seq, toks)
            else:
                verdict = self.outputs.append(seq, tok)
            out = verdict.output
            if verdict.finished:
                self.scheduler.finish(seq)
            elif seq.req.prefill_only:
                # prefill done: keep the prompt's blocks for the decode worker to pull
                out.prefilled = True
                out.kv_block_ids = self.scheduler.pin(seq)
                out.timing = timing_of(seq)
            outputs.append(out)
        return outputs

    # --- speculative decoding (workers.spec_decode) -------------------------------------
    def _speculate(self, batch: list[tuple[Seq, int, int]]) -> list[tuple[Seq, int, int]]:
        """Each decoding sequence that can take drafts gets them (from its predicted
        output, else from its own context) behind its last token, in its blocks and in
        this step's chunk."""
        spec = self.spec
        out = []
        for seq, start, end in batch:
            if end - start == 1 and end == seq.num_tokens and start >= seq.num_prompt \
                    and not seq.req.prefill_only and eligible(seq):  # fmt: skip
                drafts = self._drafts_for(seq, spec)
                if drafts and self.scheduler.kv.allocate_slots(
                        seq.id, end + len(drafts)) is not None:  # fmt: skip
                    seq.token_ids.extend(drafts)
                    self._drafts[seq.id] = drafts
                    self.spec_stats.drafts += 1
                    self.spec_stats.draft_tokens += len(drafts)
                    end += len(drafts)
            out.append((seq, start, end))
        return out

    def _drafts_for(self, seq: Seq, spec: SpecConfig | None) -> list[int]:
        """``seq``'s drafts for this step: its predicted output's next tokens, else (with
        n-gram speculation on) its context's; none past its max_tokens or the window."""
        p = seq.req.params
        k = min(spec.num_speculative_tokens if spec is not None else PREDICTION_DRAFT_TOKENS,
                p.max_tokens - len(seq.output_ids) - 1,
                self.max_model_len - seq.num_tokens - 1)  # fmt: skip
        if k <= 0:
            return []
        if p.prediction:
            if seq.prediction is None:
                seq.prediction = PredictionTracker(p.prediction)
            if drafts := seq.prediction.propose(seq.output_ids, k):
                self._predicted.add(seq.id)
                return drafts
        if spec is None:
            return []
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return seq.ngrams.propose(seq.token_ids, k)

    def _verify(
        self, batch: list[tuple[Seq, int, int]], sampled: list[Seq], tokens: list[int]
    ) -> tuple[list[tuple[Seq, int, int]], dict[str, tuple[int, list[int]]]]:
        """The drafts checked against the model's picks: each speculating sequence's tokens
        of this step (its accepted drafts, then the model's next); its context keeps the
        accepted drafts only, and only their KV (and its last token's) counts as computed."""
        last = {seq.id: tok for seq, tok in zip(sampled, tokens, strict=True)}
        spoken: dict[str, tuple[int, list[int]]] = {}
        out = []
        for seq, start, end in batch:
            drafts = self._drafts.pop(seq.id, None)
            if drafts is not None:
                picks = self._spec_picks.pop(seq.id) + [last[seq.id]]
                toks = accepted(drafts, picks)
                spoken[seq.id] = (start, toks)
                if seq.id in self._predicted:  # drafted from its predicted output
                    self._predicted.discard(seq.id)
                    assert seq.prediction is not None
                    seq.prediction.accepted += len(toks) - 1
                    seq.prediction.rejected += len(drafts) - (len(toks) - 1)
                end = start + len(toks)  # the last token's KV and the accepted drafts'
                del seq.token_ids[end:]
                self.spec_stats.accepted_tokens += len(toks) - 1
            out.append((seq, start, end))
        self._spec_picks.clear()
        return out, spoken

    def _append_all(self, seq: Seq, toks: list[int]) -> Verdict:
        """Several tokens of one step through the stop rules, as one output (up to the one
        that ends the sequence)."""
        verdict = self.outputs.append(seq, toks[0])
        out = verdict.output
        for tok in toks[1:]:
            if verdict.finished:
                break
            verdict = self.outputs.append(seq, tok)
            nxt = verdict.output
            nxt.token_ids = out.token_ids + nxt.token_ids
            nxt.text = out.text + nxt.text
            out = nxt
        verdict.output = out
        return verdict

    def _drop_drafts(self, batch: list[tuple[Seq, int, int]]) -> None:
        """A failed step: the drafts leave the contexts they were added to."""
        for seq, start, _ in batch:
            if self._drafts.pop(seq.id, None) is not None:
                del seq.token_ids[start + 1 :]
        self._spec_picks.clear()
        self._predicted.clear()

    def fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for req in self.structured.drop_all() if self.structured is not None else []:
            outs.append(failed(req.request_id, len(req.prompt_token_ids), message))
        for seq in self.scheduler.remove_all():
            out = finished(seq, [], seq.detok.finish(), "error")
            out.error = message
            outs.append(out)
        return outs

    def release_pinned(self, request_id: str) -> bool:
        return self.scheduler.release_pinned(request_id)

    def expire_pinned(self, now: float) -> list[str]:
        return self.scheduler.expire_pinned(now)

    def take_kv_events(self) -> list[KVEvent]:
        return self.scheduler.take_events()

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """vLLM's: forget every cached prefix (with ``reset_external``, the KVBM tiers'
        too); False while requests hold blocks (retry when idle)."""
        return self.scheduler.reset_prefix_cache(reset_external)

    def cached_block_hashes(self) -> list[int]:
        return self.scheduler.kv.pool.cached_hashes()

    def cached_blocks_by_tier(self) -> dict[int, list[int]]:
        return self.scheduler.cached_by_tier()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self.scheduler.set_waker(waker)
        if self.structured is not None:
            self.structured.set_waker(waker)

    def stats(self) -> EngineStats:
        st = self.scheduler.stats(self.num_steps)
        st.decode_tokens, st.decode_kv_tokens = self.decode_tokens, self.decode_kv_tokens
        sp = self.spec_stats
        st.spec_drafts, st.spec_draft_tokens = sp.drafts, sp.draft_tokens
        st.spec_accepted_tokens = sp.accepted_tokens
        return st

    # ----------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def _count_step(self, batch: list[tuple[Seq, int, int]]) -> None:
        """This step's counts (:attr:`step_counts`): a sequence computing one token past its
        prompt decodes, reading its whole context (a speculating one, each of its rows:
        workers.spec_decode); any other chunk is prefill."""
        prefill = seqs = kv = 0
        for seq, start, end in batch:
            if end - start == 1 and start >= seq.num_prompt:
                seqs += 1
                kv += end
            elif seq.id in self._drafts:
                seqs += end - start
                kv += sum(range(start + 1, end + 1))
            else:
                prefill += end - start
        c = self._step
        c.step_no = self.num_steps
        c.prefill_tokens = prefill
        c.decode_seqs = seqs
        c.decode_kv_tokens = kv
        self.decode_kv_tokens += kv

    def _start_constrained(self) -> list[RequestOutput]:
        """Start the held requests whose grammar has compiled; the failed outputs of those
        whose spec did not compile (or whose tokens so far do not follow it)."""
        outs = []
        assert self.structured is not None
        for req, constraint in self.structured.ready():
            out = (self._unconstrained(req, constraint) if isinstance(constraint, str)
                   else self._start(req, constraint))  # fmt: skip
            if out is not None:
                outs.append(out)
        return outs

    def _unconstrained(self, req: EngineRequest, why: str) -> RequestOutput | None:
        """A request whose constraint cannot be had (``why``): a best-effort one (strict
        auto tool calls) runs without it; any other ends with invalid_structured_output."""
        spec = req.params.structured
        if spec is None or not spec.best_effort:
            return _invalid_structured(req, why)
        log.warning("[%s] runs unconstrained: %s", req.request_id, why)
        return self._start(req, None)


def _invalid_structured(req: EngineRequest, why: str) -> RequestOutput:
    spec = req.params.structured
    return failed(req.request_id, len(req.prompt_token_ids), why, "invalid_structured_output",
                  spec.param if spec is not None else None)  # fmt: skip


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    return (seed * 1_000_003 + index * 7919 + 0x9E3779B9) % (2**63 - 1)
