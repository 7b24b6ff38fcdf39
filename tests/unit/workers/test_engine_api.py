"""The engine interface (workers/engine_api.py): both engines implement it, and what runs
engines (the loop, the engine process, the worker runtime, the stage tasks) reaches them
through it only, never into their scheduler, block pool or tensors."""

from __future__ import annotations

import re
from pathlib import Path

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from workers.engine import Engine
from workers.engine_api import Engine as EngineProtocol
from workers.engine_api import EngineRequest
from workers.mock_engine import MockEngine, MockTiming

ROOT = Path(__file__).resolve().parents[3]
RUNNERS = ["workers/engine_loop.py", "workers/engine_proc.py", "workers/runtime.py",
           "tasks/stages.py", "tasks/celery_ext.py"]  # fmt: skip


def test_both_engines_implement_the_protocol(tiny_model_dir: Path) -> None:
    config = engine_config(num_kv_blocks=256)
    mock = MockEngine.from_model_dir(tiny_model_dir, config, MockTiming(speedup=100))
    for engine in (Engine.from_model_dir(tiny_model_dir, config), mock):
        assert isinstance(engine, EngineProtocol)
        params = Sampling(max_tokens=2, temperature=0)
        assert engine.add_request(EngineRequest("r", [1, 5, 6], params)) is None
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        assert outs[-1].finished and outs[-1].num_output_tokens == 2
        stats = engine.stats()
        assert stats.steps == 2 and stats.blocks_used == 0 and stats.running == 0
        assert stats.prompt_tokens_seen == 3


def test_the_mock_engine_has_no_kv_a_backend_could_move(tiny_model_dir: Path) -> None:
    config = engine_config(num_kv_blocks=256)
    assert MockEngine.from_model_dir(tiny_model_dir, config, MockTiming()).kv_memory() is None
    assert Engine.from_model_dir(tiny_model_dir, config).kv_memory() is not None


def test_what_runs_engines_never_reaches_into_them() -> None:
    inside = re.compile(r"\.(scheduler|kv_manager|outputs)\b|engine\.kv\b|\.pool\.(num_|cached)")
    bad = [f"{f}:{n}: {line.strip()}" for f in RUNNERS
           for n, line in enumerate((ROOT / f).read_text().splitlines(), 1)
           if inside.search(line)]  # fmt: skip
    assert not bad, bad


def test_a_feature_an_engine_does_not_serve_is_refused_naming_its_field(
    tiny_model_dir: Path,
) -> None:
    from kvbm.protocol import REQUEST_ERROR_CODES
    from workers.engine_api import FEATURES
    from workers.stream import output_frame

    config = engine_config(num_kv_blocks=256)
    engine = MockEngine.from_model_dir(tiny_model_dir, config, MockTiming(speedup=100))
    engine.supports = frozenset(FEATURES) - {"presence_penalty"}
    out = engine.add_request(EngineRequest("r", [1, 5, 6], Sampling(presence_penalty=0.5)))
    assert out is not None and out.finished and out.finish_reason == "error"
    assert out.error_code == "unsupported_parameter" in REQUEST_ERROR_CODES
    assert out.error_param == "presence_penalty" and "mock" in (out.error or "")
    frame = output_frame(out, 0)  # what the API turns into a 400 naming the field
    assert frame.error is not None and frame.error.type == "invalid_request_error"
    assert frame.error.param == "presence_penalty"
    assert not engine.has_unfinished
    # a request that uses none of what the engine lacks runs
    assert engine.add_request(EngineRequest("s", [1, 5, 6], Sampling(max_tokens=1))) is None
