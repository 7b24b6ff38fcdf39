"""Settings by area: every environment name from before the areas still sets its field,
flat keyword arguments (CLI flags) win over the environment, ``to_env`` hands settings to
a child process unchanged, and docs/configuration.md is in step with the code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from pydantic.fields import FieldInfo

from tasks.settings import (
    AREAS,
    FLAT,
    EngineSettings,
    KvbmSettings,
    Settings,
    engine_config,
    field_info,
    markdown,
)

ROOT = Path(__file__).resolve().parents[3]

# The flat settings before they moved into areas (issue 32): each must keep its name.
OLD_NAMES = """
admission_wait_s api_keys api_keys_protect_ops block_size broker_fastpath
client_max_requests decode_attention decode_workers device disagg_min_prompt_tokens
dispatch_attempts dtype enable_prefix_caching encode_workers encoder_cache_mb
encoder_max_batch engine engine_cpus first_frame_timeout_s flower_basic_auth flower_port
flower_registry_queues frame_timeout_s heartbeat_s host kv_pin_timeout_s kv_transfer
kv_transfer_threads kvbm_cpu_cache_blocks kvbm_cpu_cache_gb kvbm_disk_cache_blocks
kvbm_disk_cache_gb kvbm_disk_dir kvbm_disk_offload_filter max_body_bytes max_model_len
max_num_batched_tokens max_num_seqs media_allow_http media_allow_internal media_ca_bundle
media_fetch_timeout_s media_max_bytes media_max_images media_max_pixels media_ttl_s
migration_limit mode model num_kv_blocks port prefill_retries prefill_workers
redis_appendonly redis_password redis_port redis_url retry_after_s router_approx_ttl_s
router_g1_weight router_g2_weight router_g3_weight router_guard_min_blocks
router_guard_ratio router_kv_events router_lease_s router_mode router_overlap_weight
router_temperature scheduler_delay_factor serve_crash_loop_exits serve_crash_loop_window_s
serve_restart serve_restart_backoff_max_s serve_restart_backoff_s serve_state_dir
served_model_name tool_call_parser torch_threads transfer_timeout_s worker_concurrency
worker_id worker_max_requests worker_nice worker_ttl_s workers
""".split()
# read outside Settings before (workers/paged_kernel.py), a setting now under its old name
NEW_NAMES = [
    "allow_credentials",
    "allow_runtime_lora_updating",
    "allowed_headers",
    "allowed_methods",
    "allowed_origins",
    "api_workers",
    "batch_api_url",
    "batch_lease_s",
    "batch_load_threshold",
    "batch_max_in_flight",
    "batch_priority",
    "batch_recover_s",
    "chat_template",
    "default_chat_template_kwargs",
    "engine_hang_timeout_s",
    "files_dir",
    "force_include_usage",
    "generation_config",
    "kernel_dir",
    "log_format",
    "log_requests",
    "lora_modules",
    "max_lora_rank",
    "max_loras",
    "otlp_traces_endpoint",
    "otlp_traces_protocol",
    "override_generation_config",
    "planner",
    "planner_compose_project",
    "planner_compose_services",
    "planner_connector",
    "planner_docker_host",
    "planner_forecaster",
    "planner_gpu_budget",
    "planner_gpus_per_worker",
    "planner_hold_timeout_s",
    "planner_itl_ms",
    "planner_k8s_api",
    "planner_k8s_ca_file",
    "planner_k8s_deployments",
    "planner_k8s_namespace",
    "planner_k8s_token_file",
    "planner_load_interval_s",
    "planner_max_workers",
    "planner_metrics_port",
    "planner_min_workers",
    "planner_pools",
    "planner_record",
    "planner_sensitivity",
    "planner_throughput_interval_s",
    "planner_ttft_ms",
    "planner_window_s",
    "reasoning_config",
    "reasoning_parser",
    "responses_store",
    "responses_store_ttl_s",
    "resumable_streams",
    "resume_grace_s",
    "resume_ttl_s",
    "return_tokens_as_token_ids",
    "root_path",
    "serve_drain_timeout_s",
    "shutdown_drain_s",
    "speculative_config",
    "ssl_ca_certs",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "stream_interval",
    "tenant_tokens_per_min",
    "trust_request_chat_template",
]


def _other_value(f: FieldInfo) -> tuple[str, Any]:
    """An environment string for ``f`` that is not its default, and the value it gives."""
    t = f.annotation
    if get_origin(t) in (Union, UnionType):
        t = next(a for a in get_args(t) if a is not type(None))
    if get_origin(t) is Literal:
        v = next(a for a in get_args(t) if a != f.default)
        return v, v
    if t is bool:
        return str(not f.default).lower(), not f.default
    if t is int:
        v = (f.default or 0) + 1
        return str(v), v
    if t is float:
        v = (f.default or 0.0) + 1.5
        return str(v), v
    if t is str:
        return "1-2", "1-2"
    return "/tmp/conveyor-settings-test", Path("/tmp/conveyor-settings-test")  # a Path


def _get(s: Settings, flat: str) -> Any:
    area, name = FLAT.get(flat, (None, flat))
    return getattr(getattr(s, area) if area else s, name)


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.upper().startswith("CONVEYOR_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("flat", OLD_NAMES)
def test_every_old_environment_name_sets_its_field(
    flat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clean_env(monkeypatch)
    f = field_info(flat)
    raw, want = ("disagg", "disagg") if flat == "mode" else _other_value(f)
    assert _get(Settings(), flat) != want
    monkeypatch.setenv(f"CONVEYOR_{flat.upper()}", raw)
    assert _get(Settings(), flat) == want
    # a flat keyword argument (a CLI flag) wins over the environment
    default = Settings.model_fields["mode"].default if flat == "mode" else f.default
    assert _get(Settings(**{flat: default}), flat) == default


def test_the_flat_names_are_exactly_the_old_ones_plus_nothing_lost() -> None:
    top = {n for n in Settings.model_fields if n not in AREAS and n not in ("vllm", "mock")}
    assert sorted(set(FLAT) | top) == sorted(OLD_NAMES + NEW_NAMES)


def test_keyword_arguments_and_the_environment_merge_within_an_area(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clean_env(monkeypatch)
    monkeypatch.setenv("CONVEYOR_ENGINE", "mock")
    monkeypatch.setenv("CONVEYOR_BLOCK_SIZE", "32")
    s = Settings(num_kv_blocks=64)
    assert (s.engine.kind, s.engine.block_size, s.engine.num_kv_blocks) == ("mock", 32, 64)
    s = Settings(engine="vllm")  # the flat name of engine.kind, not the area
    assert (s.engine.kind, s.engine.block_size) == ("vllm", 32)
    assert Settings(engine={"kind": "reference"}).engine.kind == "reference"


def test_to_env_hands_every_setting_to_a_child_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    s = Settings(
        port=9001,
        router_mode="random",
        engine="mock",
        kvbm_disk_dir="/tmp/kv",
        transfer_timeout_s=4.0,
        vllm={"max_num_seqs": 8},
        mock={"speedup": 2.0},
    )
    for k, v in s.to_env().items():
        monkeypatch.setenv(k, v)
    assert Settings() == s


def test_the_transfer_timeout_default_is_below_the_frame_timeout() -> None:
    # a stuck KV pull is retried before the client's stream gives up
    s = Settings()
    assert s.transfer.timeout_s == 10.0 < s.api.frame_timeout_s


def test_docs_configuration_md_is_generated_from_the_settings() -> None:
    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == markdown(), (
        "docs/configuration.md is out of step with tasks/settings.py: run "
        "`python -m tasks.settings --markdown > docs/configuration.md`"
    )
    for flat in OLD_NAMES:
        assert f"`CONVEYOR_{flat.upper()}`" in doc.read_text()


def test_the_markdown_command_prints_the_document() -> None:
    p = subprocess.run([sys.executable, "-m", "tasks.settings", "--markdown"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert p.stdout == markdown()


def test_engine_config_takes_its_settings_from_the_areas_alone() -> None:
    # EngineConfig (workers/, which cannot import tasks/) declares no default for a field
    # the engine or KVBM area has; engine_config() is its one builder, for `conveyor
    # worker` (from the environment) and for tests and benches (the areas' defaults)
    from dataclasses import MISSING, fields

    from workers.engine_api import EngineConfig

    engine, kvbm = EngineSettings(), KvbmSettings()
    # the KVBM tiers' sizes are not among them: the worker turns the area's GB into
    # blocks of its model (tier_blocks), and 0 blocks is a tier off
    areas = {*type(engine).model_fields, "disk_dir", "disk_offload_filter"}
    restated = [f.name for f in fields(EngineConfig) if f.name in areas
                and (f.default is not MISSING or f.default_factory is not MISSING)]  # fmt: skip
    assert restated == []
    cfg = engine_config()
    plain = engine.model_dump(exclude={"kind", "kernel_dir"})
    assert {n: getattr(cfg, n) for n in plain} == plain
    assert cfg.disk_offload_filter is kvbm.disk_offload_filter
    assert cfg.kernel_dir == str(engine.kernel_path())
    env = {"CONVEYOR_NUM_KV_BLOCKS": "77", "CONVEYOR_KERNEL_DIR": "/opt/k"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        s = Settings()
    got = engine_config(s, namespace="m", max_num_seqs=3)
    want = (77, "/opt/k", "m", 3)
    assert (got.num_kv_blocks, got.kernel_dir, got.namespace, got.max_num_seqs) == want


def test_the_cli_help_shows_each_settings_default_from_settings() -> None:
    # every flag that names a setting shows that setting's default (none: nothing), as
    # Settings has it, so the help cannot drift from it
    import re

    import click

    from tasks.cli import main

    seen = 0
    for cmd in main.commands.values():
        for p in cmd.params:
            m = re.search(r"\[CONVEYOR_([A-Z_]+)\](?: \((.*)\))?$", getattr(p, "help", "") or "")
            if m is None or m.group(1).lower() not in {*FLAT, *Settings.model_fields}:
                continue
            default = field_info(m.group(1).lower()).get_default(call_default_factory=True)
            if default is not None:
                assert m.group(2) == str(default).replace(str(Path.home()), "~"), p.name
            seen += 1
            assert isinstance(p, click.Option)
    assert seen >= 40  # every command's setting flags (45 today)


@pytest.mark.parametrize("bad", ["collector:4318", "grpc://c:4317", "http://"])
def test_a_traces_endpoint_must_be_an_http_url(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    with pytest.raises(ValueError, match="not an http"):
        Settings(otlp_traces_endpoint=bad)
    monkeypatch.setenv("CONVEYOR_OTLP_TRACES_ENDPOINT", "")  # compose's empty default: off
    assert Settings().otlp_traces_endpoint is None
    assert Settings(otlp_traces_endpoint="https://c/v1/traces").otlp_traces_endpoint


def test_reasoning_markers_come_from_the_config_over_the_parser() -> None:
    from tasks.settings import ApiSettings

    assert ApiSettings().reasoning_markers() is None
    parsed = ApiSettings(reasoning_parser="qwen3")
    assert parsed.reasoning_markers() == ("<think>", "</think>", "</think>")
    phrase = ApiSettings(reasoning_parser="deepseek_r1", reasoning_config=json.dumps(
        {"reasoning_end_str": "Time to answer.</think>"}))  # fmt: skip
    assert phrase.reasoning_markers() == ("<think>", "Time to answer.</think>", "</think>")
    own = ApiSettings(reasoning_config={"reasoning_start_str": "<r>", "reasoning_end_str": "</r>"})
    assert own.reasoning_markers() == ("<r>", "</r>", "</r>")
    assert ApiSettings(reasoning_config={"reasoning_start_str": "<r>"}).reasoning_markers() is None
    for bad in ({"reasoning_parser": "qwen3"}, {"reasoning_end_str": ""}, "not json"):
        with pytest.raises(ValueError):
            ApiSettings(reasoning_config=bad if isinstance(bad, str) else json.dumps(bad))


def test_cors_lists_and_https_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    a = Settings().api
    assert a.cors == {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"],
                      "allow_credentials": False} and a.scheme == "http"  # fmt: skip
    monkeypatch.setenv("CONVEYOR_ALLOWED_ORIGINS", '["https://a.example", "https://b.example"]')
    monkeypatch.setenv("CONVEYOR_ALLOWED_HEADERS", "authorization, content-type")
    monkeypatch.setenv("CONVEYOR_SSL_CERTFILE", "/tmp/c.pem")
    a = Settings().api
    assert a.cors is not None and a.cors["allow_origins"] == ["https://a.example",
                                                              "https://b.example"]  # fmt: skip
    assert a.cors["allow_headers"] == ["authorization", "content-type"] and a.scheme == "https"
    monkeypatch.setenv("CONVEYOR_ALLOWED_ORIGINS", "")
    assert Settings().api.cors is None  # no CORS headers at all
    monkeypatch.setenv("CONVEYOR_ALLOWED_ORIGINS", "[not json")
    with pytest.raises(ValueError, match="allowed_origins"):
        Settings()


def test_several_served_names_the_first_is_the_models_id(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    monkeypatch.setenv("CONVEYOR_SERVED_MODEL_NAME", "main-name, other ,")
    s = Settings()
    assert s.model_names == ["main-name", "other"] and s.model_name == "main-name"
    monkeypatch.delenv("CONVEYOR_SERVED_MODEL_NAME")
    s = Settings()
    assert s.model_names == [s.model.name] == [s.model_name]
