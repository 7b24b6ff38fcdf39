"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.model_init import init_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny LLaVA checkpoint, written once per test session."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-llava")
