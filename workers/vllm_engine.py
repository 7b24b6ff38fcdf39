"""vLLM as a Conveyor engine: its V1 async engine (``AsyncLLM``) behind the engine protocol.

The engine process runs :class:`VllmEngine` in the same :class:`workers.engine_loop.
EngineLoop` as the reference engine, so frames, KV events, stats and cancellation take the
same paths. ``AsyncLLM`` lives on an asyncio loop of its own thread and spawns vLLM's
EngineCore process (which computes the steps); each request is one ``generate`` coroutine
whose delta outputs are queued for :meth:`VllmEngine.step`, which the loop thread calls
and which blocks until outputs come (woken early when the loop has commands).

* Prompts go to vLLM as token ids (the API tokenized and templated them); text, stop
  strings, ``max_tokens`` and finish reasons are vLLM's own (its detokenizer), and
  ``usage.cached_tokens`` is vLLM's prefix-cache hit (``num_cached_tokens``).
* Abort: the request's coroutine is cancelled, which makes ``AsyncLLM`` abort it in the
  EngineCore (its KV blocks go back); the abort output is returned at once.
* KV events: vLLM publishes them on a ZMQ socket of this engine's own
  (``--kv-events-config``); :mod:`workers.vllm_events` reads them and renames each block
  in Conveyor's hashes, which :meth:`take_kv_events` hands to the same publisher as the
  reference engine's.
* Disaggregation: vLLM moves KV itself (its KV connector: NIXL). A prefill request runs
  with ``max_tokens=1`` and ``do_remote_decode``; its output's ``kv_transfer_params`` go
  into Conveyor's prefill handle; the decode request carries them back to vLLM, which
  pulls the blocks (:attr:`workers.engine_api.EngineRequest.kv_transfer_params`).
* Images: embeddings another worker made go to vLLM as image embeddings; otherwise the
  image itself, and vLLM's own vision tower encodes it. Either way the image's content
  hash is its uuid in vLLM, which names it in the KV events.

vLLM's options come as its own CLI flags (``vllm serve``'s, e.g. ``--max-num-seqs=8``),
parsed by vLLM's parser (:func:`engine_args`). vLLM is imported lazily: this module loads
without it (the main suite's layering checks import every module).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import tempfile
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.lora import LoraRef
from cluster.stats import EngineStats, TransferTotals
from kvbm.block_pool import KVEvent
from kvbm.protocol import G1, LOGPROB_FLOOR, Pooling, StructuredOutput, model_namespace
from workers.engine_api import (
    FEATURES,
    EngineConfig,
    EngineRequest,
    RequestOutput,
    StepCounts,
    failed,
    refuse_prompt,
    refuse_unsupported,
)
from workers.pooling import refusal
from workers.structured import GrammarError, grammar_text
from workers.vllm_events import KVEventTranslator, ZmqEventReader

log = logging.getLogger(__name__)

IMAGE_NAMES = 4096

# Conveyor's finish reasons; vLLM's others ("repetition") stop the sequence like a stop
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def engine_args(
    model_dir: str | Path, config: EngineConfig, vllm_args: Sequence[str],
    kv_events: dict | None = None, kv_role: str | None = None,
):  # fmt: skip
    """vLLM's ``AsyncEngineArgs`` for serving ``model_dir``: the Conveyor settings that
    mean the same in vLLM first, then ``vllm_args`` (``vllm serve`` flags: they win), then
    Conveyor's KV event publisher (``kv_events``: the router's index depends on it).
    ``kv_role`` (``kv_producer`` on a prefill pool, ``kv_consumer`` on a decode pool):
    unless ``vllm_args`` configure a KV connector, vLLM's NIXL connector (its KV buffer in
    host memory where vLLM runs on the CPU)."""
    import json

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        f"--model={model_dir}",
        f"--max-num-seqs={config.max_num_seqs}",
        f"--max-num-batched-tokens={config.max_num_batched_tokens}",
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
        # vLLM's periodic stat lines and Prometheus registry stay off; its scheduler stats
        # still reach this engine's own logger (the heartbeat)
        "--disable-log-stats",
    ]
    if config.max_model_len:
        argv.append(f"--max-model-len={config.max_model_len}")
    if config.enable_lora:  # the deployment serves LoRA adapters (lora_modules, runtime)
        argv += ["--enable-lora", f"--max-loras={config.max_loras}",
                 f"--max-lora-rank={config.max_lora_rank}"]  # fmt: skip
    if kv_role is not None and not any(a.startswith("--kv-transfer-config") for a in vllm_args):
        from vllm.platforms import current_platform

        kv: dict = {"kv_connector": "NixlConnector", "kv_role": kv_role}
        if current_platform.device_type == "cpu":
            kv["kv_buffer_device"] = "cpu"
        argv.append(f"--kv-transfer-config={json.dumps(kv)}")
    argv += list(vllm_args)
    if kv_events is not None:
        argv.append(f"--kv-events-config={json.dumps(kv_events)}")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="conveyor-vllm"))
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def vllm_argv(options: dict[str, object]) -> list[str]:
    """``{"max_num_seqs": 8, "enforce_eager": True}`` -> ``["--max-num-seqs=8",
    "--enforce-eager"]``: ``CONVEYOR_VLLM__<OPTION>`` settings as ``vllm serve`` flags.
    ``false`` gives ``--no-<option>``; dicts and lists go as JSON."""
    import json

    out = []
    for key, value in options.items():
        flag = "--" + key.strip().lstrip("-").replace("_", "-").lower()
        text = value if isinstance(value, str) else json.dumps(value)
        low = text.lower() if isinstance(text, str) else ""
        if value is True or low == "true":
            out.append(flag)
        elif value is False or low == "false":
            out.append("--no-" + flag[2:])
        else:
            out.append(f"{flag}={text}")
    return out


@dataclass(slots=True)
class _Req:
    prompt_tokens: int
    prefill_only: bool
    future: object = None  # concurrent.futures.Future of its coroutine
    output_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False  # its first output came (it left vLLM's waiting queue)
    seed: int | None = None  # prefill: the seed the decode worker's vLLM samples with too
    # decode after a remote prefill: vLLM samples the first token again (the same one:
    # same seed); the prefill worker streamed it and this many characters of text already
    skip_tokens: int = 0
    skip_chars: int = 0
    first_token: int | None = None
    resumed: int = 0  # output tokens sent before a migration (they join vLLM's prompt)
    top_logprobs: int | None = None  # the request's logprobs (top k per token), if asked
    top_prompt_logprobs: int = 0  # its prompt_logprobs (top k per prompt token)


class VllmEngine:
    """The engine protocol (:class:`workers.engine_api.Engine`) over vLLM's ``AsyncLLM``."""

    name = "vllm"
    # the optional sampling features (workers.engine_api.FEATURES) passed on to vLLM, which
    # serves them all with the same meanings (vLLM's names are Sampling's). n > 1 reaches
    # it as one request per choice (workers.choices), as vLLM fans a request out itself;
    # its prefix cache shares the prompt's blocks
    supports: frozenset[str] = frozenset(FEATURES)
    # vLLM runs its own steps in its own loop: step() here only collects outputs, so there
    # are no per-step counts (step_samples stays empty, decode_kv_tokens 0); decode_tokens
    # counts the tokens its outputs carried
    step_counts: StepCounts | None = None

    def __init__(
        self, model_dir: str | Path, config: EngineConfig, vllm_args: Sequence[str] = (),
        tag: str = "", kv_role: str | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        # the served model's tokenizer (the API's too): bad words' token ids back to words
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._reqs: dict[str, _Req] = {}
        self._out: deque[tuple[str, object]] = deque()  # (request id, vLLM output | error)
        self._cv = threading.Condition()
        self._woken = False
        self._flush_pending = False
        self._wake_loop: Callable[[], None] = lambda: None
        self._events: list[KVEvent] = []
        self._ev_lock = threading.Lock()
        # image content hash -> its placeholder count, for the KV events' image keys; the
        # most recent IMAGE_NAMES only (an image older than that has left vLLM's cache)
        self._image_tokens: OrderedDict[str, int] = OrderedDict()
        # LoRA adapters vLLM was handed: (name, path) -> its int id, and back to the name
        # (vLLM's KV events name an adapter's blocks by the id)
        self._lora_ids: dict[tuple[str, str], int] = {}
        self._lora_names: dict[int, str] = {}
        self._sched = None  # the last SchedulerStats vLLM reported
        self._counts = EngineStats()
        # KV pulled by vLLM's connector (decode side), as the heartbeat's kv_transfer
        self._kv_moved = TransferTotals("vllm-connector")
        self._closed = False

        # vLLM's processes (EngineCore and its workers) are this process's children. A
        # process group of their own keeps a terminal's Ctrl-C or a group SIGTERM meant
        # for the Celery worker from stopping them under running requests (the engine
        # process ignores those; vLLM's EngineCore would shut down); the worker kills
        # the group if this process dies (workers.engine_proc.EngineClient).
        try:
            os.setpgid(0, 0)
        except OSError:  # a session leader cannot move (and leads its own group already)
            pass
        import multiprocessing

        # the engine process is started daemonic (it dies with its worker), and a daemonic
        # process may not start children; vLLM must (its EngineCore)
        multiprocessing.current_process().daemon = False

        sock = Path(tempfile.gettempdir()) / f"cvy-vllm-{os.getpid()}-{tag or 'x'}"
        self._kv_endpoint = f"ipc://{sock}.kv"
        self._kv_replay = f"ipc://{sock}.kvr"
        kv_events = None
        self._translator: KVEventTranslator | None = None
        self._reader: ZmqEventReader | None = None
        if config.record_kv_events and config.enable_prefix_caching:
            kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": self._kv_endpoint, "replay_endpoint": self._kv_replay,
                         "topic": "kv"}  # fmt: skip
            self._translator = KVEventTranslator(config.block_size,
                                                 model_namespace(config.namespace),
                                                 self._image_tokens.get,
                                                 self._lora_namespace)  # fmt: skip
            # connected before vLLM binds (ipc allows it): no batch is missed at start
            self._reader = ZmqEventReader(self._kv_endpoint, self._kv_replay,
                                          self._on_vllm_events, topic="kv").start()  # fmt: skip
        if kv_role is not None:
            # NIXL's side channel: a port of this worker's own (several on one host); set
            # VLLM_NIXL_SIDE_CHANNEL_HOST to an address other hosts reach, across hosts
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
        self.args = engine_args(model_dir, config, vllm_args, kv_events, kv_role)

        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="vllm-asyncio",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        try:
            self.llm = self._call(self._create()).result()
        except BaseException:
            self._aloop.call_soon_threadsafe(self._aloop.stop)
            if self._reader is not None:
                self._reader.close()
            raise
        cache = self.llm.vllm_config.cache_config
        self.vllm_block_size = cache.block_size
        self.num_blocks = cache.num_gpu_blocks or 0
        self.max_model_len = self.llm.model_config.max_model_len
        # vLLM runs a model either for generation or for pooling (``runner: pooling``, as
        # `vllm serve --runner pooling`): a pooling engine serves /v1/embeddings only
        self.pooling = getattr(self.llm.model_config, "runner_type", "generate") == "pooling"
        log.info("vLLM engine ready: block size %d (Conveyor's %d), %d KV blocks, context %d%s",
                 self.vllm_block_size, config.block_size, self.num_blocks,
                 self.max_model_len, ", pooling runner: embeddings only" if self.pooling
                 else "")  # fmt: skip

    async def _create(self):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(self.args, stat_loggers=[self._stat_logger])

    def _policy(self) -> str:
        """vLLM's scheduling policy: ``fcfs`` (its default) or ``priority``."""
        policy = getattr(self.llm.vllm_config.scheduler_config, "policy", "fcfs")
        return str(getattr(policy, "value", policy))

    def _stat_logger(self, vllm_config, engine_index: int = 0):
        """vLLM's per-engine stat logger factory: ours keeps the last scheduler stats."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Keep(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0) -> None:  # fmt: skip
                if scheduler_stats is not None:
                    engine._sched = scheduler_stats
                    if scheduler_stats.kv_connector_stats:
                        engine._count_transfers(scheduler_stats.kv_connector_stats)
                if iteration_stats is not None:
                    engine._counts.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)

            def log_engine_initialized(self) -> None:
                pass

        return _Keep(vllm_config, engine_index)

    async def _stop_output_handler(self) -> None:
        handler = self.llm.output_handler
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._aloop)

    # --- the engine loop's side ----------------------------------------------------------
    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """``waker`` rouses the engine loop (KV events came while it idles)."""
        self._wake_loop = waker or (lambda: None)

    def wake(self) -> None:
        """The loop has commands: return from :meth:`step` now."""
        with self._cv:
            self._woken = True
            self._cv.notify()

    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        rid = req.request_id
        if rid in self._reqs:
            log.warning("[%s] is already running: the second copy is dropped", rid)
            return None
        n = len(req.prompt_token_ids)
        if self.pooling:
            return failed(rid, n, "this worker's vLLM engine runs the model for pooling "
                          "(runner pooling): it serves /v1/embeddings only",
                          "unsupported_parameter")  # fmt: skip
        if (refused := refuse_prompt(rid, n, self.max_model_len)) is not None:
            return refused
        if (refused := refuse_unsupported(rid, n, req.params, self.name,
                                          self.supports)) is not None:  # fmt: skip
            return refused
        if req.priority and self._policy() != "priority":
            return failed(rid, n, "priority other than 0 needs vLLM's priority scheduling: "
                          "set CONVEYOR_VLLM__SCHEDULING_POLICY=priority on the workers",
                          "unsupported_parameter", "priority")  # fmt: skip
        lora = None
        if req.lora is not None:
            if not self.llm.vllm_config.lora_config:
                return failed(rid, n, "this worker's vLLM engine was started without LoRA "
                              "(CONVEYOR_LORA_MODULES or CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING "
                              "turn it on)", "unsupported_parameter", "model")  # fmt: skip
            lora = self._lora_request(req.lora)
        st = _Req(n, req.prefill_only and req.params.max_tokens > 1)
        st.top_logprobs = req.params.logprobs
        st.top_prompt_logprobs = req.params.prompt_logprobs or 0
        if req.imported is not None:
            if not req.kv_transfer_params or "vllm" not in req.kv_transfer_params:
                return failed(
                    rid,
                    n,
                    "the vLLM engine takes prefilled KV through its KV "
                    "connector only (a handle from a vLLM prefill worker)",
                )
            st.skip_tokens, st.skip_chars = 1, req.imported.emitted_chars
            st.first_token = req.imported.first_token
        elif req.resumed is not None:
            # migration: the tokens out so far join the prompt (vLLM recomputes their KV)
            # and count as output; max_tokens and min_tokens go on from there
            done = list(req.resumed.output_token_ids)
            if n + len(done) >= self.max_model_len or len(done) >= req.params.max_tokens:
                return failed(rid, n, f"cannot resume after {len(done)} output tokens: the "
                                       "request was already complete")  # fmt: skip
            if req.params.structured is not None:
                # vLLM starts a grammar at the prompt's end: it cannot continue one over the
                # tokens already out (the reference engine replays its matcher over them)
                return failed(rid, n, "the vLLM engine cannot resume a structured-output "
                                      "request on another worker")  # fmt: skip
            st.resumed = len(done)
            st.output_tokens = len(done)
        try:
            sp = self._sampling(req, st)
            prompt = self._prompt(req)
        except GrammarError as e:
            so = req.params.structured
            param = (so.param if so is not None else None) or "structured_outputs"
            return failed(rid, n, f"{param}: {e}", "invalid_structured_output", param)
        except (TypeError, ValueError) as e:
            return failed(rid, n, f"vLLM refused the request: {e}")
        self._reqs[rid] = st
        st.future = self._call(self._run(rid, prompt, sp, req.priority, lora))
        return None

    def embed_prompt(self, request_id: str, token_ids: list[int],
                     params: Pooling) -> RequestOutput:  # fmt: skip
        """One embedding request through vLLM's pooling runner (``AsyncLLM.encode``), run
        to its end: the embedding runner's thread waits on it while vLLM schedules it
        beside its other requests. vLLM pools, normalises and cuts to ``dimensions`` by
        the model's own pooling config, as `vllm serve` does; a classification (a
        sequence classifier's) comes back as its raw logits."""
        n = len(token_ids)
        if not self.pooling:
            return refusal(request_id, n, self.name, "this worker's vLLM engine runs the "
                           "model for generation; vLLM serves embeddings from an engine "
                           "started for pooling: a worker of its own with "
                           "CONVEYOR_VLLM__RUNNER=pooling")  # fmt: skip
        if (refused := refuse_prompt(request_id, n, self.max_model_len)) is not None:
            return refused
        from vllm.exceptions import VLLMClientError
        from vllm.pooling_params import PoolingParams

        if params.task == "classify":  # raw logits: the API applies the activation
            pp = PoolingParams(task="classify", use_activation=False)
        else:
            pp = PoolingParams(task="embed", dimensions=params.dimensions,
                               use_activation=params.normalize)  # fmt: skip
        try:
            vector = self._call(self._encode(request_id, token_ids, pp)).result()
        except VLLMClientError as e:  # what vLLM's server answers with a 400
            return failed(request_id, n, f"vLLM refused the request: {e}",
                          "unsupported_parameter")  # fmt: skip
        return RequestOutput(request_id, [], "", finished=True, finish_reason="stop",
                             num_prompt_tokens=n,
                             embedding=base64.b64encode(vector).decode())  # fmt: skip

    async def _encode(self, rid: str, token_ids: list[int], pp: object) -> bytes:
        """The pooled vector of ``token_ids`` as little-endian float32 bytes."""
        import torch
        from vllm.inputs import TokensPrompt

        last = None
        async for out in self.llm.encode(TokensPrompt(prompt_token_ids=token_ids), pp, rid):
            last = out
        assert last is not None, "vLLM's encode ended without an output"
        data = last.outputs.data.to(device="cpu", dtype=torch.float32).contiguous()
        return data.numpy().astype("<f4", copy=False).tobytes()

    def abort(self, request_id: str) -> RequestOutput | None:
        st = self._reqs.pop(request_id, None)
        if st is None:
            return None
        st.future.cancel()  # type: ignore[attr-defined]  # generate() aborts it in vLLM
        return RequestOutput(request_id, [], "", finished=True, finish_reason="abort",
                             num_prompt_tokens=st.prompt_tokens,
                             num_output_tokens=st.output_tokens,
                             num_cached_tokens=st.cached_tokens)  # fmt: skip

    def step(self) -> list[RequestOutput]:
        with self._cv:
            if not self._out and not self._woken and self._reqs:
                self._cv.wait(1.0)
            self._woken = False
            items = list(self._out)
            self._out.clear()
        outs: list[RequestOutput] = []
        for rid, item in items:
            st = self._reqs.get(rid)
            if st is None:
                continue  # aborted: its abort output went out already
            out = self._convert(rid, st, item)
            if out.finished or out.prefilled:
                del self._reqs[rid]
                self._counts.prompt_tokens_seen += st.prompt_tokens
                self._counts.prompt_tokens_cached += st.cached_tokens
            outs.append(out)
        if items:
            self._counts.steps += 1
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self._reqs):
            out = self.abort(rid)
            if out is not None:
                out.finish_reason, out.error = "error", message
                outs.append(out)
        return outs

    @property
    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._events)

    @property
    def stalled(self) -> bool:
        return False  # vLLM schedules its own KV; step() blocks until it has outputs

    @property
    def has_pinned(self) -> bool:
        return False  # prefilled KV waits in vLLM's connector, which times it out itself

    # --- disaggregation: vLLM's KV connector moves the KV, not a Conveyor backend --------
    def release_pinned(self, request_id: str) -> bool:
        return False

    def expire_pinned(self, now: float) -> list[str]:
        return []

    def kv_memory(self) -> object | None:
        return None

    # --- the router's index and metrics ---------------------------------------------------
    @property
    def records_kv_events(self) -> bool:
        return self._translator is not None

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """vLLM's own (its running requests are never reset from here: False while blocks
        are held); ``reset_external``: its KV connector's cache too."""
        return bool(self._call(self.llm.reset_prefix_cache(False, reset_external)).result())

    def freeze(self) -> None:
        """A ``keep`` pause (workers.engine_loop): vLLM's own scheduler stops, its requests
        kept where they are (vLLM's ``pause_generation(mode="keep")``)."""
        self._call(self.llm.pause_generation(mode="keep", clear_cache=False)).result()

    def thaw(self) -> None:
        self._call(self.llm.resume_generation()).result()

    def take_kv_events(self) -> list[KVEvent]:
        if not self._events:
            return []
        with self._ev_lock:
            events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[int]:
        if self._translator is None:
            return []
        with self._ev_lock:
            return self._translator.cached_hashes()

    def cached_blocks_by_tier(self) -> dict[int, list[int]]:
        # vLLM's own offload tiers are not Conveyor's index (workers.vllm_events)
        return {G1: self.cached_block_hashes()}

    def stats(self) -> EngineStats:
        st = self._counts
        sched = self._sched
        waiting = sum(1 for r in list(self._reqs.values()) if not r.started)
        running = len(self._reqs) - waiting
        used = 0
        if sched is not None:
            running, waiting = sched.num_running_reqs, sched.num_waiting_reqs
            used = round(sched.kv_cache_usage * self.num_blocks)
        cached = self._translator.num_blocks if self._translator is not None else 0
        return EngineStats(running=running, waiting=waiting, blocks_used=used,
                           blocks_total=self.num_blocks, blocks_cached=cached,
                           prompt_tokens_seen=st.prompt_tokens_seen,
                           prompt_tokens_cached=st.prompt_tokens_cached,
                           preemptions=st.preemptions, steps=st.steps,
                           decode_tokens=st.decode_tokens)  # fmt: skip

    def extra_stats(self, st: EngineStats) -> None:
        """What the heartbeat carries beyond the engine's counts: vLLM's own count of the
        requests it holds, and the KV its connector pulled."""
        st.vllm_unfinished = self.num_unfinished()
        if self._kv_moved.count or self._kv_moved.failed:
            st.kv_transfer = replace(self._kv_moved)

    def _count_transfers(self, stats: dict) -> None:
        """Fold one report of vLLM's KV connector stats (NIXL's: lists of per-transfer
        bytes and durations, perhaps under the connector's name) into the totals."""
        for data in [stats, *(v for v in stats.values() if isinstance(v, dict))]:
            moved = data.get("bytes_transferred")
            if isinstance(moved, list):
                self._kv_moved.count += len(moved)
                self._kv_moved.bytes += int(sum(moved))
                self._kv_moved.seconds += float(sum(data.get("transfer_duration") or ()))
                self._kv_moved.failed += len(data.get("num_failed_transfers") or ())

    def num_unfinished(self) -> int:
        """Requests vLLM itself still holds (its output processor's count)."""
        return self.llm.get_num_unfinished_requests()

    def close(self) -> None:
        """Abort what runs, shut vLLM's processes down, stop the threads."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._reqs):
            self.abort(rid)
        try:
            # its output handler would report the EngineCore's exit as a failure
            self._call(self._stop_output_handler()).result(5.0)
            self.llm.shutdown()
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("vLLM shutdown")
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(5.0)
        if self._reader is not None:
            self._reader.close()

    # ----------------------------------------------------------------------------------
    def _sampling(self, req: EngineRequest, st: _Req):
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        p = req.params
        extra = {}
        max_tokens, seed = p.max_tokens - st.resumed, p.seed
        if st.prefill_only:  # the decode worker's vLLM pulls the KV this one keeps
            max_tokens = 1
            extra["kv_transfer_params"] = {"do_remote_decode": True}
            if seed is None and not p.greedy:  # both sides must draw the same first token
                seed = int.from_bytes(os.urandom(4), "little")
            st.seed = seed
        elif req.kv_transfer_params is not None:
            extra["kv_transfer_params"] = dict(req.kv_transfer_params["vllm"])
            if seed is None:
                seed = req.kv_transfer_params.get("seed")
        # the prompt's logprobs come from whoever computes the prompt: not a decode worker
        # whose KV came from a prefill worker, nor a migrated request (sent already)
        prompt_logprobs = p.prompt_logprobs
        if req.imported is not None or req.resumed is not None:
            prompt_logprobs = None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            min_p=p.min_p,
            seed=seed,
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            include_stop_str_in_output=p.include_stop_str_in_output,
            ignore_eos=p.ignore_eos,
            min_tokens=min(max(p.min_tokens - st.resumed, 0), max_tokens),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=dict(p.logit_bias) or None,
            allowed_token_ids=list(p.allowed_token_ids) if p.allowed_token_ids else None,
            bad_words=self._bad_words(p.bad_words) or None,
            logprobs=p.logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=_structured(p.structured),
            skip_special_tokens=p.skip_special_tokens,
            # its markers are the engine's (--reasoning-parser or --reasoning-config, set
            # from the same settings: tasks.cli._vllm_options)
            thinking_token_budget=None if p.thinking is None else p.thinking.budget,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )

    def _bad_words(self, sequences: list[list[int]]) -> list[str]:
        """The API sends bad words as token ids (both spellings: at the start of the text and
        after a space); vLLM takes the words and derives both spellings itself, so the
        spaced one's text, stripped, is the word again."""
        words: list[str] = []
        for ids in sequences:
            word = self._tokenizer.decode(ids).strip()
            if word and word not in words:
                words.append(word)
        return words

    def _prompt(self, req: EngineRequest) -> dict:
        ids = list(req.prompt_token_ids)
        if req.resumed is not None:
            ids += req.resumed.output_token_ids
        prompt: dict = {"prompt_token_ids": ids}
        if req.params.cache_salt:  # vLLM salts the prompt's first block with it
            prompt["cache_salt"] = req.params.cache_salt
        if req.mm_inputs:
            data, uuids = [], []
            for m in sorted(req.mm_inputs, key=lambda m: m.offset):
                data.append(m.image if m.image is not None else m.embeds)
                if m.image_hash:
                    uuids.append(m.image_hash)
                    if m.num_tokens:
                        self._image_tokens[m.image_hash] = m.num_tokens
                        self._image_tokens.move_to_end(m.image_hash)
                        while len(self._image_tokens) > IMAGE_NAMES:
                            self._image_tokens.popitem(last=False)
            prompt["multi_modal_data"] = {"image": data}
            if len(uuids) == len(data):
                prompt["multi_modal_uuids"] = {"image": uuids}
        return prompt

    def _lora_namespace(self, lora_id: int) -> int | None:
        """The namespace of the blocks of the adapter vLLM knows as ``lora_id``."""
        name = self._lora_names.get(lora_id)
        return None if name is None else model_namespace(self.config.namespace, name)

    def _lora_request(self, ref: LoraRef):
        """vLLM's ``LoRARequest`` for ``ref``: an int id per (name, path), kept, so vLLM
        loads each adapter once and reloads one registered again from another path."""
        from vllm.lora.request import LoRARequest

        key = (ref.name, ref.path)
        lid = self._lora_ids.get(key)
        if lid is None:
            lid = self._lora_ids[key] = len(self._lora_ids) + 1
            self._lora_names[lid] = ref.name
        return LoRARequest(lora_name=ref.name, lora_int_id=lid, lora_path=ref.path)

    async def _run(self, rid: str, prompt: dict, sp, priority: int = 0, lora=None) -> None:
        try:
            async for out in self.llm.generate(prompt, sp, rid, priority=priority,
                                               lora_request=lora):  # fmt: skip
                self._push(rid, out)
        except asyncio.CancelledError:
            raise  # aborted here: generate() has told vLLM
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            log.warning("[%s] vLLM failed the request: %s", rid, e)
            self._push(rid, e)

    def _push(self, rid: str, item: object) -> None:
        """On the asyncio thread: queue an output. The step waiting is woken once per
        round of the asyncio loop (``call_soon`` runs after every request's coroutine
        that this round of vLLM outputs resumed), so one step takes them all."""
        self._out.append((rid, item))
        if not self._flush_pending:
            self._flush_pending = True
            self._aloop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        with self._cv:
            self._cv.notify()

    def _convert(self, rid: str, st: _Req, item: object) -> RequestOutput:
        if isinstance(item, BaseException):
            out = failed(rid, st.prompt_tokens, f"vLLM: {type(item).__name__}: {item}")
            out.num_output_tokens, out.num_cached_tokens = st.output_tokens, st.cached_tokens
            return out
        st.started = True
        co = item.outputs[0]  # type: ignore[attr-defined]
        toks, text = list(co.token_ids), co.text or ""
        st.output_tokens += len(toks)
        self._counts.decode_tokens += len(toks)
        st.cached_tokens = item.num_cached_tokens or 0  # type: ignore[attr-defined]
        k = st.top_logprobs
        logprobs = None
        if k is not None and co.logprobs is not None:
            logprobs = [_logprob(e, t, k) for e, t in zip(co.logprobs, toks, strict=True)]
        if st.skip_tokens and toks:  # the prefill worker streamed the first token
            if toks[0] != st.first_token:
                log.warning("[%s] decode's first token %d != the prefill's %d", rid, toks[0],
                            st.first_token)  # fmt: skip
            toks, st.skip_tokens = toks[1:], 0
            logprobs = logprobs[1:] if logprobs is not None else None
        if st.skip_chars and text:
            cut = min(len(text), st.skip_chars)
            text, st.skip_chars = text[cut:], st.skip_chars - cut
        finished = bool(item.finished)  # type: ignore[attr-defined]
        out = RequestOutput(rid, toks, text, num_prompt_tokens=st.prompt_tokens,
                            num_output_tokens=st.output_tokens,
                            num_cached_tokens=st.cached_tokens, logprobs=logprobs)  # fmt: skip
        plp = getattr(item, "prompt_logprobs", None)
        if plp:  # on the first output only
            out.prompt_logprobs = _prompt_logprobs(plp, list(item.prompt_token_ids),  # type: ignore[attr-defined]
                                                   st.top_prompt_logprobs)  # fmt: skip
        if st.prefill_only and finished and co.finish_reason == "length":
            # prefill done: vLLM holds the prompt's KV for the decode worker's connector
            out.prefilled = True
            out.kv_transfer_params = {"backend": "vllm-connector", "seed": st.seed,
                                      "vllm": item.kv_transfer_params}  # type: ignore[attr-defined]  # fmt: skip
            return out
        if finished:
            out.finished = True
            out.finish_reason = FINISH_REASONS.get(str(co.finish_reason), "stop")
            out.stop_reason = co.stop_reason
        return out

    def _on_vllm_events(self, events: list[object]) -> None:
        """On the ZMQ reader's thread: rename, queue, and wake the engine loop."""
        assert self._translator is not None
        with self._ev_lock:
            new = self._translator.translate(events)
            if not new:
                return
            self._events.extend(new)
        self._wake_loop()


def _structured(spec: StructuredOutput | None):
    """vLLM's structured-output parameters for a request's constraint: the grammar the
    reference engine enforces for it (workers.structured: JSON's whitespace as the request
    says, and the fixes to xgrammar 0.2.8's JSON strings vLLM's own conversion lacks), as
    EBNF for vLLM's xgrammar backend. Raises GrammarError for a spec with no grammar."""
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if spec.structural_tag is not None:  # vLLM takes both forms of a structural tag itself
        return StructuredOutputsParams(structural_tag=spec.structural_tag)
    return StructuredOutputsParams(grammar=grammar_text(spec))


def _logprob(entry: dict, token_id: int, k: int) -> list:
    """One position of vLLM's logprobs (token id -> Logprob(logprob, rank, ...), the chosen
    token's and the top k) as a ``kvbm.protocol.Logprob``; -inf (a token a grammar or a
    ban masked, among the top k) reads LOGPROB_FLOOR, as the reference engine's do: JSON
    has no -inf."""
    chosen = entry[token_id]
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= k)
    return [max(chosen.logprob, LOGPROB_FLOOR), chosen.rank,
            [[tid, max(lp, LOGPROB_FLOOR)] for _, tid, lp in top]]  # fmt: skip


def _prompt_logprobs(entries: list, prompt_ids: list[int], k: int) -> list:
    """vLLM's prompt logprobs (None for the first token) as ``kvbm.protocol.Logprob``s."""
    return [None if e is None else _logprob(e, tok, k)
            for e, tok in zip(entries, prompt_ids, strict=True)]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
