"""An engine that cannot start says why in one line: not installed (how to install it),
out of memory (the setting that sizes it)."""

from __future__ import annotations

import importlib.util
import signal
import sys

import pytest

from workers.start_errors import (
    engine_missing,
    killed_while_starting,
    out_of_memory,
)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_not_installed_says_how_to_install_it() -> None:
    line = engine_missing("vllm")
    assert line is not None and "\n" not in line
    assert "vLLM, which is not installed" in line and sys.executable in line
    assert "`make install-vllm`" in line


def test_engines_that_need_nothing_more_are_never_missing() -> None:
    assert engine_missing("reference") is None
    assert engine_missing("mock") is None


# what vLLM says when memory runs out at start: its CPU worker's check, in process; its
# EngineCore killed by the OOM killer, as AsyncLLM reports it; torch's own error
VLLM_CPU = ("ValueError: Available memory on node 0 (3.1/15.6 GiB) on startup is less than "
            "desired CPU memory utilization (0.92, 14.4 GiB).")  # fmt: skip
CORE_KILLED = ("RuntimeError: Engine core initialization failed. See root cause above. "
               "Failed core proc(s): {'EngineCore_DP0': -9}")  # fmt: skip
TORCH = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize("error", [VLLM_CPU, CORE_KILLED, TORCH])
def test_vllm_out_of_memory_names_the_setting(error: str) -> None:
    line = out_of_memory("vllm", error)
    assert line is not None and "\n" not in line
    assert error in line
    assert "CONVEYOR_VLLM__GPU_MEMORY_UTILIZATION" in line and "gpu_memory_utilization" in line


def test_other_errors_are_not_called_out_of_memory() -> None:
    exited = CORE_KILLED.replace("-9", "1")  # a Python error in the EngineCore: not memory
    assert out_of_memory("vllm", exited) is None
    assert out_of_memory("reference", "OSError: config.json not found") is None
    assert "CONVEYOR_NUM_KV_BLOCKS" in (out_of_memory("reference", TORCH) or "")


def test_an_engine_killed_while_starting_points_at_memory() -> None:
    line = killed_while_starting("vllm", -signal.SIGKILL)
    assert line is not None and "CONVEYOR_VLLM__GPU_MEMORY_UTILIZATION" in line
    assert killed_while_starting("vllm", 1) is None
    assert killed_while_starting("reference", None) is None
