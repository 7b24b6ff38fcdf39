"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from workers.model_init import init_model

# tests/vllm/ runs in a venv of its own (`make test-vllm`: vLLM pins its own torch and
# transformers); where vLLM is not installed, the suite does not even collect it
collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["vllm/*"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny LLaVA checkpoint, written once per test session."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-llava")
