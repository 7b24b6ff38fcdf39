"""vLLM engine options: CONVEYOR_VLLM__* settings and --vllm-arg, as `vllm serve` flags."""

from __future__ import annotations

import click
import pytest

from tasks.cli import _configure_with_vllm
from workers.vllm_engine import vllm_argv


def test_env_options_become_vllm_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_VLLM__MAX_NUM_SEQS", "8")
    monkeypatch.setenv("CONVEYOR_VLLM__ENFORCE_EAGER", "true")
    monkeypatch.setenv("CONVEYOR_VLLM__ENABLE_CHUNKED_PREFILL", "false")
    monkeypatch.setenv("CONVEYOR_VLLM__KV_TRANSFER_CONFIG", '{"kv_connector": "NixlConnector"}')
    s = _configure_with_vllm((), engine="vllm")
    assert s.engine.kind == "vllm"
    assert sorted(vllm_argv(s.vllm)) == sorted([
        "--max-num-seqs=8", "--enforce-eager", "--no-enable-chunked-prefill",
        '--kv-transfer-config={"kv_connector": "NixlConnector"}',
    ])  # fmt: skip


def test_vllm_arg_overrides_env_and_takes_json_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_VLLM", '{"dtype": "float32", "block_size": 32}')
    s = _configure_with_vllm(("--block-size=64", "max-num-seqs=4"))
    assert vllm_argv(s.vllm) == ["--dtype=float32", "--block-size=64", "--max-num-seqs=4"]
    assert vllm_argv({"hf_overrides": {"a": 1}, "seed": 3}) == [
        '--hf-overrides={"a": 1}',
        "--seed=3",
    ]


def test_a_vllm_arg_without_a_value_is_refused() -> None:
    with pytest.raises(click.BadParameter, match="KEY=VALUE"):
        _configure_with_vllm(("enforce-eager",))
