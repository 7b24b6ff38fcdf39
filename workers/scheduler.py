"""The continuous-batching scheduler: which sequences compute which tokens each step, and
the KV blocks they hold. No model, no torch.

Each step schedules running sequences first (one decode token each, or the next chunk of a
prefill), then admits waiting ones while the token budget, the sequence cap and free KV
blocks allow; when a running sequence cannot get a block, the most recently admitted one
is preempted (its blocks freed, recomputed later): vLLM's recompute policy. A new or
preempted sequence starts on the cached blocks of its longest cached prefix.

Priorities (vLLM's ``priority``: lower values first) order the waiting queue: a request
queues behind every waiting one of its value or lower, a preempted one goes back in front
of its own value; the sequence preempted is the most recently admitted of the running
ones with the highest value; and when the batch is full, a waiting sequence of a lower
value than a running one preempts it (recomputed later). A step prefills prompts of one
priority only, and a prompt of a worse priority than a running sequence's alone (the
batch class takes what online work leaves a prompt at a time, so it lengthens an online
step by one prompt at most). With every priority equal (the default 0) that is first come,
first served, exactly.

A request of ``n`` choices comes as ``n`` sequences: the later ones wait (parked) until
the first has computed the prompt, then fork from it in the step that does (sharing its
full blocks, a copy of its partial last one, and the logits of its first token), so the
prompt is computed once.

For disaggregation the scheduler also keeps a prefilled request's blocks pinned until a
decode worker has pulled them (or a timeout); on the decode side the pull is a load (below).

**Loading KV.** A request whose KV comes from elsewhere waits, holding its blocks, in a
loading state while the others keep running: blocks of its prefix found in the KVBM's
lower tiers (G2 host memory, G3 disk; :mod:`kvbm.offload`) are onboarded into fresh G1
blocks, and a disaggregated decode's prompt KV is pulled by its
:class:`workers.engine_api.KVSource`. The copies run on loader threads; each step first
collects those that ended (and the offload copies that ended) and puts their requests
back at the head of the queue, to continue from the tokens that arrived. Nothing on the
step's path waits for a copy.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.stats import EngineStats, KvbmCounters
from kvbm.block_pool import KVCacheManager, KVEvent
from kvbm.offload import OffloadManager, OnboardJob
from kvbm.protocol import G1, model_namespace
from workers.detokenizer import IncrementalDetokenizer
from workers.engine_api import EngineConfig, EngineRequest, KVSource

if TYPE_CHECKING:
    from workers.spec_decode import NgramIndex, PredictionTracker
    from workers.structured import Constraint

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
    scheduled: float = 0.0  # when it first ran a step (monotonic; 0: not yet)
    first_token: float = 0.0  # when its first output token was sampled (monotonic)
    matched: bool = False  # its cached prefix was looked up (again after a preemption)
    counted: bool = False  # its prompt entered the prefix-cache statistics
    offered: int = 0  # blocks of its chain known to be in G2 (where the next offer starts)
    # its last prefix lookup, counted (statistics, disk admission) once it is admitted:
    # (hashes, blocks hit in G1, blocks looked for, tiers of the blocks found below G1)
    lookup: tuple[list[int], int, int, list[int]] | None = None
    # the later choices of its request (n > 1) waiting for its prompt, to fork from it
    forks: list[Seq] = field(default_factory=list)
    constraint: Constraint | None = None  # a structured output's grammar state
    sampling: object | None = None  # the engine's per-request sampling state
    adapter: object | None = None  # the engine's loaded LoRA adapter (req.lora's weights)
    ngrams: NgramIndex | None = None  # its n-gram index, when it speculates (spec_decode)
    prediction: PredictionTracker | None = None  # its predicted output's place (spec_decode)

    @property
    def whole_prompt(self) -> bool:
        """Its prompt logprobs are still owed (they go out with its first token): every
        prompt position must be computed, none found in the prefix cache (as vLLM does)."""
        return (self.req.params.prompt_logprobs is not None and not self.output_ids
                and self.req.imported is None)  # fmt: skip

    @property
    def importing(self) -> bool:
        """A disaggregated decode whose prompt KV is still to be pulled."""
        imp = self.req.imported
        return imp is not None and imp.source is not None and self.num_preemptions == 0

    @property
    def import_source(self) -> KVSource:
        """Where an importing sequence's prompt KV comes from."""
        imp = self.req.imported
        assert imp is not None and imp.source is not None, f"{self.id} imports no KV"
        return imp.source

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class _Load:
    """A request in the loading state: KV on its way into blocks it holds."""

    seq: Seq
    job: OnboardJob | None = None  # blocks onboarded from G2 / G3
    source: KVSource | None = None  # or a disaggregated prefill's KV
    block_ids: list[int] = field(default_factory=list)
    base: int = 0  # tokens computed before the load (its G1 prefix hit)
    aborted: bool = False  # dropped meanwhile: its blocks are freed when the copy ends
    report: bool = True  # when aborted: end it with an "abort" output then
    result: int | BaseException | None = None  # blocks loaded, or what the copy raised


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
        self.loads: dict[str, _Load] = {}  # requests in the loading state
        self.dropped: list[Seq] = []  # aborted while loading, to end with an abort output
        self.parked: dict[str, Seq] = {}  # a later choice (n > 1) -> the seq it forks from
        self._loads_done: deque[_Load] = deque()  # appended by loader threads
        self._loader: ThreadPoolExecutor | None = None
        self._waker: Callable[[], None] | None = None
        self.offload: OffloadManager | None = None  # the KVBM tiers below G1, if any
        self.prompt_tokens_seen = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_computed = 0
        self.num_pin_expired = 0
        self.num_preemptions = 0
        self.last_prefill_s = 0.0  # duration of the last step that ran a prompt chunk

    # ----------------------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return (
            request_id in self.loads
            or request_id in self.parked
            or any(s.id == request_id for s in (*self.running, *self.waiting))
        )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loads or self.parked)

    def attach_offload(self, offload: OffloadManager) -> None:
        """Use the KVBM tiers below G1 (offload on naming, onboarding on a prefix hit)."""
        self.offload = offload if offload.enabled else None
        if self.offload is not None:
            self.offload.set_waker(self._waker)

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self._waker = waker
        if self.offload is not None:
            self.offload.set_waker(waker)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self._loader is not None:
            self._loader.shutdown(wait=False)

    def add(self, seq: Seq) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or a lower value."""
        w, p = self.waiting, seq.req.priority
        if not w or w[-1].req.priority <= p:
            w.append(seq)
        else:
            w.insert(next(i for i, s in enumerate(w) if s.req.priority > p), seq)

    def _requeue(self, seq: Seq) -> None:
        """Put ``seq`` back in front of the waiting sequences of its priority (it had its
        turn: preempted, or its KV just loaded)."""
        w, p = self.waiting, seq.req.priority
        if not w or w[0].req.priority >= p:
            w.appendleft(seq)
        else:
            w.insert(next((i for i, s in enumerate(w) if s.req.priority >= p), len(w)), seq)

    def _make_room_by_priority(self) -> None:
        """A waiting sequence of a lower priority value than a running one takes its place
        when the batch is full (``max_num_seqs``): the running one is preempted, to
        recompute later (a batch job's request gives way to an online one). Never with
        equal priorities."""
        cap = self.config.max_num_seqs
        while self.waiting and self.running and len(self.running) >= cap:
            if self.waiting[0].req.priority >= max(s.req.priority for s in self.running):
                return
            self._preempt(self.running.pop(self._victim()))

    def _victim(self) -> int:
        """The running sequence to preempt: the most recently admitted of those with the
        highest priority value (the last one when all are equal)."""
        worst = max(s.req.priority for s in self.running)
        return max(i for i, s in enumerate(self.running) if s.req.priority == worst)

    def schedule(self) -> list[tuple[Seq, int]]:
        """This step's work: ``(sequence, tokens to compute)`` pairs, blocks allocated."""
        self.poll()
        self._make_room_by_priority()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while self.kv.allocate_slots(seq.id, seq.num_computed + n) is None:
                k = self._victim()
                victim = self.running.pop(k)
                if k < i:  # scheduled earlier in this step: its tokens go back
                    j = next(j for j, (s, _) in enumerate(scheduled) if s is victim)
                    budget += scheduled.pop(j)[1]
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break  # the next running one is at i now
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        if preempted or not self._admit_now():
            return scheduled
        # Prompts of different priorities are not prefilled in one step, and one of a worse
        # priority than a running sequence's comes in alone: a batch-class prompt adds at
        # most one prompt's time to a step the more urgent sequences wait on.
        urgent = min((s.req.priority for s in self.running), default=None)
        admitted: int | None = None  # the priority of the prompts this step admits
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            p = seq.req.priority
            if admitted is not None and (p != admitted or (urgent is not None and p > urgent)):
                break
            if seq.forks and self.running and \
                    len(self.running) + 1 + len(seq.forks) > self.config.max_num_seqs:  # fmt: skip
                break  # its choices join the batch with it
            if seq.importing and not seq.matched:
                if not self._start_import(seq):
                    break
                continue
            if not seq.matched:  # new or preempted: start on its cached prefix
                started = self._match(seq)
                if started is None:
                    break  # no room for the blocks to onboard into
                if started:
                    continue  # loading its prefix's KV from G2 / G3
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self.kv.allocate_slots(seq.id, seq.num_computed + n) is None:
                if self.kv.has(seq.id):  # give the cached blocks back until there is room
                    self.kv.free(seq.id)
                    seq.num_computed = 0
                    seq.matched = False
                    seq.offered = 0
                break
            self._commit_lookup(seq)
            if seq.num_preemptions == 0 and seq.req.imported is None and not seq.counted:
                seq.counted = True
                # onboarded tokens included; a resumed request counts its prompt's only
                seq.num_cached = min(seq.num_computed, seq.num_prompt)
                self.prompt_tokens_seen += seq.num_prompt
                self.prompt_tokens_cached += seq.num_cached
            self.waiting.popleft()
            self.running.append(seq)
            if not seq.scheduled:
                seq.scheduled = time.monotonic()
            scheduled.append((seq, n))
            budget -= n
            admitted = p
        if self._imports_waiting:
            self._expire_imports()
        return scheduled

    def computed(self, seq: Seq, end: int) -> None:
        """``seq``'s tokens up to ``end`` are computed: name its full blocks (and write
        them through to the tiers below)."""
        if seq.num_computed < seq.num_prompt:
            self.prompt_tokens_computed += min(end, seq.num_prompt) - seq.num_computed
        seq.num_computed = end
        named = self.kv.cache_blocks(seq.id, seq.token_ids, end)
        if self.offload is not None and named > seq.offered:
            seq.offered = self.offload.offer(self.kv.block_table(seq.id),
                                             self.kv.block_hashes(seq.id), seq.offered)  # fmt: skip

    def finish(self, seq: Seq) -> None:
        """``seq`` is done: it leaves the batch and its blocks are freed."""
        self.running.remove(seq)
        self.kv.free(seq.id)
        if seq.forks:
            self._unpark(seq)

    def pin(self, seq: Seq) -> list[int]:
        """``seq`` is prefilled: it leaves the batch, its blocks stay for a decode worker
        to pull until released or ``kv_pin_timeout_s`` passes. Returns the blocks."""
        self.running.remove(seq)
        self.pinned[seq.id] = time.monotonic() + self.config.kv_pin_timeout_s
        return list(self.kv.block_table(seq.id))

    def remove(self, request_id: str) -> Seq | None:
        """Take a request out of the queues and free its blocks; ``None`` if not there. A
        request loading KV gives its blocks back once the copy into them has ended."""
        load = self.loads.get(request_id)
        if load is not None:  # ends with an abort output once the copy has ended
            load.aborted = True
            return None
        parent = self.parked.pop(request_id, None)
        if parent is not None:
            seq = next(s for s in parent.forks if s.id == request_id)
            parent.forks.remove(seq)
            return seq
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.id == request_id:
                    queue.remove(seq)
                    self.kv.free(seq.id)
                    if seq.forks:
                        self._unpark(seq)
                    return seq
        return None

    def remove_all(self) -> list[Seq]:
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self.kv.free(seq.id)
        for parent in {id(p): p for p in self.parked.values()}.values():
            seqs += parent.forks  # parked: no blocks yet
            parent.forks = []
        self.parked.clear()
        self.running.clear()
        self.waiting.clear()
        for load in self.loads.values():
            if not load.aborted or load.report:
                seqs.append(load.seq)
            load.aborted, load.report = True, False
        self.dropped.clear()
        return seqs

    def take_dropped(self) -> list[Seq]:
        """Requests aborted while loading KV whose copies have ended: to end now."""
        out, self.dropped = self.dropped, []
        return out

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    # --- n > 1: a request's later choices fork from its first ----------------------------
    def park(self, seq: Seq, parent_id: str) -> bool:
        """Hold ``seq``, a later choice of a request, until its first choice ``parent_id``
        has computed the prompt they share. False when there is no such prompt to wait for
        (the first choice is gone or past its prompt, or its KV comes from elsewhere):
        ``seq`` then runs as a request of its own (sharing the prompt's cached blocks)."""
        parent = next((s for s in (*self.waiting, *self.running) if s.id == parent_id), None)
        if (parent is None or parent.output_ids or parent.req.imported is not None
                or parent.req.prefill_only or parent.token_ids != seq.token_ids):  # fmt: skip
            return False
        parent.forks.append(seq)
        self.parked[seq.id] = parent
        return True

    def forks_due(self, sampled: list[Seq]) -> list[tuple[Seq, Seq]]:
        """The (first choice, later choice) pairs to fork this step: the choices parked on
        a sequence of ``sampled`` (its prompt completes now), as many as free blocks allow
        (one each for a partial last block); the others run as requests of their own."""
        due: list[tuple[Seq, Seq]] = []
        free = self.kv.pool.num_free
        for parent in sampled:
            if not parent.forks:
                continue
            assert not parent.output_ids, "choices parked on a sequence past its prompt"
            need = self.kv.fork_blocks(parent.num_prompt)
            forks, parent.forks = parent.forks, []
            for child in forks:
                del self.parked[child.id]
                if free >= need:
                    free -= need
                    due.append((parent, child))
                else:
                    self._requeue(child)
        return due

    def fork(self, parent: Seq, child: Seq) -> tuple[int, int] | None:
        """``child`` starts on ``parent``'s computed prompt and joins the batch: the full
        blocks are shared; a partial last block is the returned (parent's, child's) pair,
        whose KV the engine copies."""
        pair = self.kv.fork(parent.id, child.id, parent.num_prompt)
        child.num_computed = parent.num_prompt
        child.matched = child.counted = True  # its prompt was seen (and counted) once
        child.num_cached = parent.num_cached
        child.offered = parent.offered
        self.running.append(child)
        return pair

    def _unpark(self, parent: Seq) -> None:
        """``parent`` left before its prompt was computed: its choices run on their own."""
        for child in parent.forks:
            del self.parked[child.id]
            self.add(child)
        parent.forks = []

    # --- disaggregation, prefill side (the decode side's pull is a load) ---------------------
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

    # --- loading KV (onboarding from the tiers below G1, disagg imports) --------------------
    def poll(self) -> None:
        """Collect the copies that ended: offload copies, and loads (their requests go back
        to the head of the queue, or are dropped)."""
        if self.offload is not None:
            self.offload.poll()
        while self._loads_done:
            self._finish_load(self._loads_done.popleft())
        self.flush()

    def flush(self) -> None:
        """Send the step's offload copies (one job per tier for the whole step)."""
        if self.offload is not None:
            self.offload.flush()

    def _match(self, seq: Seq) -> bool | None:
        """Start ``seq`` on its cached prefix: G1's blocks, then those found in G2 / G3,
        which it waits for in the loading state (True). ``None``: no room to onboard."""
        if seq.whole_prompt:  # its blocks are still named, for the requests after it
            seq.matched, seq.num_computed = True, 0
            self.kv.allocate_slots(seq.id, 0, seq.req.block_extra_keys, self._namespace(seq))
            return False
        m = self.kv.match_prefix(seq.id, seq.token_ids, seq.req.block_extra_keys,
                                 self._namespace(seq))  # fmt: skip
        seq.matched = True
        seq.num_computed = m.tokens
        off = self.offload
        if off is None or not m.hashes:
            return False
        bs = self.config.block_size
        g1 = m.tokens // bs
        limit = min(len(m.hashes), (seq.num_tokens - 1) // bs)  # a token left to compute
        tiers = off.match(m.hashes, g1, limit)
        seq.lookup = (m.hashes, g1, limit, tiers)
        if not tiers:
            return False
        alloc = self.kv.allocate_slots(seq.id, (g1 + len(tiers)) * bs)
        if alloc is None:
            if self.kv.has(seq.id):
                self.kv.free(seq.id)
            seq.matched = False
            seq.num_computed = 0
            return None
        table = alloc.block_ids
        self._commit_lookup(seq)
        job = off.start_onboard(seq.id, m.hashes, g1, tiers, table[g1 : g1 + len(tiers)])
        self._start_load(_Load(seq, job=job, base=m.tokens))
        return True

    def _namespace(self, seq: Seq) -> int | None:
        """The namespace ``seq``'s blocks are named in: its LoRA adapter's and its cache
        salt's, else the pool's (None)."""
        lora, salt = seq.req.lora, seq.req.params.cache_salt
        if lora is None and not salt:
            return None
        return model_namespace(self.config.namespace, lora.name if lora else None, salt)

    def _commit_lookup(self, seq: Seq) -> None:
        """``seq`` is admitted (to run, or to load): its prefix lookup counts now, for the
        statistics (first admission only) and the tiers' recency and disk admission."""
        if seq.lookup is None or self.offload is None:
            return
        hashes, g1, limit, tiers = seq.lookup
        seq.lookup = None
        if not seq.counted:
            self.offload.count_lookup(g1, limit, tiers)
        self.offload.on_hit(hashes[: g1 + len(tiers)], self.kv.block_table(seq.id)[:g1])

    def _start_import(self, seq: Seq) -> bool:
        """A disaggregated decode: blocks for its prompt, filled by its KV source while it
        waits in the loading state. False: no room yet."""
        alloc = self.kv.allocate_slots(seq.id, seq.num_prompt, seq.req.block_extra_keys,
                                       self._namespace(seq))  # fmt: skip
        if alloc is None:
            return False
        seq.matched = True
        source = seq.import_source
        self._start_load(_Load(seq, source=source, block_ids=list(alloc.block_ids)))
        return True

    @property
    def _imports_waiting(self) -> bool:
        return any(s.importing and not s.matched for s in self.waiting)

    def _expire_imports(self) -> None:
        """Imports still waiting for blocks past their deadline fail (the decode task
        prefills again elsewhere)."""
        now = time.monotonic()
        for seq in [s for s in self.waiting if s.importing and not s.matched]:
            source = seq.import_source
            if now > source.deadline:
                self.waiting.remove(seq)
                self.kv.free(seq.id)
                source.failed("no free KV blocks to receive the prefill")

    def _start_load(self, load: _Load) -> None:
        seq = load.seq
        self.waiting.remove(seq)
        self.loads[seq.id] = load
        if self._loader is None:
            self._loader = ThreadPoolExecutor(2, thread_name_prefix="kv-load")
        self._loader.submit(self._run_load, load)

    def _run_load(self, load: _Load) -> None:
        """A loader thread: the copy itself."""
        try:
            if load.job is not None:
                load.result = load.job.run()
            else:
                assert load.source is not None
                load.source.load(load.block_ids)
                load.result = len(load.block_ids)
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread
            load.result = e
        self._loads_done.append(load)
        if self._waker is not None:
            self._waker()

    def _finish_load(self, load: _Load) -> None:
        seq = load.seq
        del self.loads[seq.id]
        res = load.result
        if isinstance(res, BaseException) and load.job is not None:
            log.error("[%s] onboarding KV failed: %r; recomputing", seq.id, res)
            load.job.loaded = 0
        if load.job is not None:
            assert self.offload is not None
            loaded = self.offload.finish_onboard(load.job)
        else:
            loaded = 0 if isinstance(res, BaseException) else int(res or 0)
        if load.aborted:
            self.kv.free(seq.id)
            if load.report:
                self.dropped.append(seq)
            if seq.forks:
                self._unpark(seq)
            return
        if load.source is not None:
            if isinstance(res, BaseException):
                self.kv.free(seq.id)
                load.source.failed(str(res) or type(res).__name__)
                return
            seq.num_computed = seq.num_prompt  # the prompt's KV is in its blocks
        else:
            seq.num_computed = load.base + loaded * self.config.block_size
            self.computed(seq, seq.num_computed)  # name the onboarded blocks in G1
        self._requeue(seq)

    # --- the router's index and metrics ---------------------------------------------------
    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget the prefix cache (vLLM's ``reset_prefix_cache``): every cached block of
        the pool and, with ``reset_external``, of the KVBM tiers below it. All or
        nothing: False while a sequence holds blocks or a copy is under way."""
        pool, off = self.kv.pool, self.offload if reset_external else None
        if not pool.resettable or (off is not None and not off.resettable):
            return False
        ok = pool.reset()
        if off is not None:
            ok = off.reset() and ok
        return ok

    def take_events(self) -> list[KVEvent]:
        events = self.kv.pool.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        return events

    def cached_by_tier(self) -> dict[int, list[int]]:
        out = {G1: self.kv.pool.cached_hashes()}
        if self.offload is not None:
            out.update(self.offload.cached_by_tier())
        return out

    def stats(self, steps: int) -> EngineStats:
        pool = self.kv.pool
        off = self.offload
        occ = off.occupancy() if off is not None else {}
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting) + len(self.parked),
            blocks_used=pool.num_used,
            blocks_total=pool.num_blocks,
            blocks_cached=pool.num_cached,
            blocks_pinned=len(self.pinned),
            prompt_tokens_seen=self.prompt_tokens_seen,
            prompt_tokens_cached=self.prompt_tokens_cached,
            prompt_tokens_computed=self.prompt_tokens_computed,
            pins_expired=self.num_pin_expired,
            preemptions=self.num_preemptions,
            steps=steps,
            loading=len(self.loads),
            host_blocks_used=occ.get("host_blocks_used", 0),
            host_blocks_total=occ.get("host_blocks_total", 0),
            disk_blocks_used=occ.get("disk_blocks_used", 0),
            disk_blocks_total=occ.get("disk_blocks_total", 0),
            kvbm=KvbmCounters(**off.report()) if off is not None else None,
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
        seq.matched = False
        seq.offered = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(seq)
        log.info("preempted %s (recompute %d tokens)", seq.id, seq.num_tokens)
