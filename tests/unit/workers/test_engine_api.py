"""The engine interface (workers/engine_api.py): both engines implement it, and what runs
engines (the loop, the engine process, the worker runtime, the stage tasks) reaches them
through it only, never into their scheduler, block pool or tensors."""

from __future__ import annotations

import re
from pathlib import Path

from workers.engine import Engine
from workers.engine_api import Engine as EngineProtocol
from workers.engine_api import EngineConfig, EngineRequest
from workers.mock_engine import MockEngine, MockTiming
from workers.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
RUNNERS = ["workers/engine_loop.py", "workers/engine_proc.py", "workers/runtime.py",
           "tasks/stages.py", "tasks/celery_ext.py"]  # fmt: skip


def test_both_engines_implement_the_protocol(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=256)
    mock = MockEngine.from_model_dir(tiny_model_dir, config, MockTiming(speedup=100))
    for engine in (Engine.from_model_dir(tiny_model_dir, config), mock):
        assert isinstance(engine, EngineProtocol)
        params = SamplingParams(max_tokens=2, temperature=0)
        assert engine.add_request(EngineRequest("r", [1, 5, 6], params)) is None
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        assert outs[-1].finished and outs[-1].num_output_tokens == 2
        stats = engine.stats()
        assert stats.steps == 2 and stats.blocks_used == 0 and stats.running == 0
        assert stats.prompt_tokens_seen == 3


def test_the_mock_engine_has_no_kv_a_backend_could_move(tiny_model_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=256)
    assert MockEngine.from_model_dir(tiny_model_dir, config, MockTiming()).kv_memory() is None
    assert Engine.from_model_dir(tiny_model_dir, config).kv_memory() is not None


def test_what_runs_engines_never_reaches_into_them() -> None:
    inside = re.compile(r"\.(scheduler|kv_manager|outputs)\b|engine\.kv\b|\.pool\.(num_|cached)")
    bad = [f"{f}:{n}: {line.strip()}" for f in RUNNERS
           for n, line in enumerate((ROOT / f).read_text().splitlines(), 1)
           if inside.search(line)]  # fmt: skip
    assert not bad, bad
