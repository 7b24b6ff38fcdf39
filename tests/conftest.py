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


# Folders whose tests start processes (redis-server, workers, the API, containers), and the
# fixtures that do: every such test carries the `integration` marker (`-m "not integration"`
# is then the quick suite), and a test that lacks it stops the collection.
PROCESS_DIRS = ("integration", "vllm", "compose")
PROCESS_FIXTURES = frozenset(
    {"redis_url", "redis_dbs", "fresh_db", "cluster", "own_redis", "vllm_dbs"}
)


def unmarked_process_tests(items: list[pytest.Item]) -> list[str]:
    """The node ids of tests that start processes but lack the `integration` marker."""
    here = Path(__file__).parent
    out = []
    for item in items:
        rel = Path(item.path).relative_to(here) if Path(item.path).is_relative_to(here) else None
        starts = (rel is not None and rel.parts[0] in PROCESS_DIRS) or bool(
            PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        )
        if starts and item.get_closest_marker("integration") is None:
            out.append(item.nodeid)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = unmarked_process_tests(items)
    if missing:
        raise pytest.UsageError(
            "these tests start processes but lack the `integration` marker "
            "(pytestmark = pytest.mark.integration):\n  " + "\n  ".join(missing)
        )
