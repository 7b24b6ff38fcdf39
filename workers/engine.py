"""The reference engine: continuous batching over the paged Llama forward pass.

``Engine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``.
Each step schedules running sequences first (one decode token each, or the next chunk of a
prefill), then admits waiting ones while the token budget, the sequence cap and free KV
blocks allow; when a running sequence cannot get a block, the most recently admitted one
is preempted (its blocks freed, recomputed later) — vLLM's recompute policy. One flattened
forward pass serves the whole step.

``EngineLoop`` owns an ``Engine`` on one thread. Other threads (Celery task threads, the
cancel listener) submit and abort through it; every step's outputs go to a sink callback.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kvbm.block_pool import KVCacheManager
from kvbm.hashing import namespace_hash
from workers.checkpoint import TextModelConfig, load_text_weights
from workers.detokenizer import IncrementalDetokenizer
from workers.llama import AttentionMetadata, LlamaModel, PagedKVCache, PrefillSegment
from workers.sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


@dataclass(slots=True)
class _Seq:
    req: EngineRequest
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    token_ids: list[int]  # prompt + output
    num_prompt: int
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at first admission

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        cfg = model.cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
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
        )
        self.prompt_tokens_seen = 0  # prefix-cache hit rate = cached / seen
        self.prompt_tokens_cached = 0
        self.kv = PagedKVCache(cfg, config.num_kv_blocks, bs, model.dtype, str(model.device))
        self.eos_ids = set(cfg.eos_token_ids)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.pinned: dict[str, float] = {}  # prefilled request -> deadline (monotonic)
        self.reserved: set[str] = set()  # decode side: blocks taken, KV being pulled
        self.reserved_aborted: set[str] = set()  # aborted mid-pull: freed once it ends
        self.num_pin_expired = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.stalled = False  # work waits but nothing fits (blocks pinned or reserved)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig) -> Engine:
        d = Path(model_dir)
        cfg = TextModelConfig.from_dir(d)
        weights = load_text_weights(d, _DTYPES[config.dtype], config.device)
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        return cls(LlamaModel(cfg, weights), tok, config)

    # ----------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request. Returns a finished error output if it can never run."""
        n = len(req.prompt_token_ids)
        if n == 0:
            return self._error(req, "prompt is empty")
        if n >= self.max_model_len:
            return self._error(
                req, f"prompt has {n} tokens; the context window is {self.max_model_len}"
            )
        gen = None if req.params.greedy else make_generator(req.params.seed)
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
        """Schedule, run one forward pass, sample, and report per-request outputs."""
        scheduled = self._schedule()
        self.stalled = not scheduled and self.has_unfinished
        if not scheduled:
            return []
        self.num_steps += 1
        logits, sampled_seqs = self._run(scheduled)
        outputs: list[RequestOutput] = []
        if sampled_seqs:
            params = [s.req.params for s in sampled_seqs]
            banned = [self._banned(s) for s in sampled_seqs]
            gens = [s.generator for s in sampled_seqs]
            for seq in sampled_seqs:
                if seq.generator is not None and seq.req.params.seed is not None:
                    # a seed per (request seed, token index): the same token is drawn
                    # whichever worker samples it (prefill or decode, agg or disagg)
                    seq.generator.manual_seed(token_seed(seq.req.params.seed,
                                                         len(seq.output_ids)))  # fmt: skip
            tokens = sample(logits, params, gens, banned)  # type: ignore[arg-type]
            for seq, tok in zip(sampled_seqs, tokens, strict=True):
                forced = seq.req.forced_first_token
                if forced is not None and not seq.output_ids:
                    tok = forced
                outputs.append(self._append(seq, tok))
        return outputs

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
        if preempted:
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

    def _preempt(self, seq: _Seq) -> None:
        self.kv_manager.free(seq.id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (recompute %d tokens)", seq.id, seq.num_tokens)

    # ----------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------
    def _run(self, scheduled: list[tuple[_Seq, int]]) -> tuple[torch.Tensor, list[_Seq]]:
        bs = self.config.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decodes: list[tuple[int, int, list[int]]] = []
        logits_index: list[int] = []
        sampled: list[_Seq] = []
        for seq, n in scheduled:
            start, end = seq.num_computed, seq.num_computed + n
            table = self.kv_manager.block_table(seq.id)
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decodes.append((row, end, table))
            else:
                nb = -(-end // bs)
                bt = torch.tensor(table[:nb], dtype=torch.long, device=self.model.device)
                prefills.append(PrefillSegment(row, n, end, bt))
            seq.num_computed = end
            self.kv_manager.cache_blocks(seq.id, seq.token_ids, end)
            if end == seq.num_tokens:
                logits_index.append(len(ids) - 1)
                sampled.append(seq)
        dev = self.model.device
        attn = AttentionMetadata.build(
            torch.tensor(slots, dtype=torch.long, device=dev),
            prefills,
            decodes,
            bs,
            self.model.cfg.num_layers,
            dev,
        )
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            attn,
            self.kv,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
        return logits, sampled

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


OutputSink = Callable[[list[RequestOutput]], None]


class EngineLoop:
    """Runs an :class:`Engine` on its own thread; thread-safe submit / abort."""

    def __init__(self, engine: Engine, sink: OutputSink, name: str = "engine-loop") -> None:
        self.engine = engine
        self._sink = sink
        self._inbox: deque[tuple[str, object]] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_seconds_total = 0.0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def submit(self, req: EngineRequest) -> None:
        self._post(("add", req))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result in a future."""
        fut: Future = Future()
        self._post(("call", (fn, fut)))
        return fut

    def stats(self) -> dict[str, float]:
        e = self.engine
        return {
            "running": len(e.running),
            "waiting": len(e.waiting),
            "blocks_used": e.kv_manager.pool.num_used,
            "blocks_pinned": len(e.pinned),
            "blocks_cached": e.kv_manager.pool.num_cached,
            "prompt_tokens_seen": e.prompt_tokens_seen,
            "prompt_tokens_cached": e.prompt_tokens_cached,
            "pins_expired": e.num_pin_expired,
            "blocks_total": e.kv_manager.pool.num_blocks,
            "preemptions": e.num_preemptions,
            "steps": e.num_steps,
            "step_seconds": round(self.step_seconds_total, 3),
        }

    # ----------------------------------------------------------------------------------
    def _post(self, item: tuple[str, object]) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def _drain(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                out = self.engine.add_request(arg)  # type: ignore[arg-type]
            elif kind == "call":
                fn, fut = arg  # type: ignore[misc]
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - hand it to the caller
                    fut.set_exception(e)
                out = None
            else:
                out = self.engine.abort(arg)  # type: ignore[arg-type]
            if out is not None:
                outs.append(out)
        return outs

    def _run(self) -> None:
        while True:
            with self._cv:
                if self.engine.stalled and not self._inbox and not self._stopped:
                    # nothing fits until blocks come back (a release, an expiry, an abort)
                    self._cv.wait(0.05)
                while not self._stopped and not self._inbox and not self.engine.has_unfinished:
                    # with pinned blocks around, wake up now and then to expire them
                    if not self._cv.wait(1.0 if self.engine.pinned else None):
                        break
                if self._stopped:
                    return
                outs = self._drain()
                if self.engine.pinned:
                    self.engine.expire_pinned(time.monotonic())
            try:
                t0 = time.perf_counter()
                outs.extend(self.engine.step())
                self.step_seconds_total += time.perf_counter() - t0
            except Exception:  # noqa: BLE001 - the loop must survive to serve others
                log.error("engine step failed:\n%s", traceback.format_exc())
                outs.extend(self.engine.fail_all("internal engine error; see worker log"))
            if outs:
                try:
                    self._sink(outs)
                except Exception:  # noqa: BLE001
                    log.exception("output sink failed")
