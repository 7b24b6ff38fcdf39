"""LoRA adapters in the reference engine: greedy tokens equal Hugging Face ``generate``
through PEFT's own loading of the same adapter files (written by PEFT), with the base model
and two adapters mixed in one engine's batches; an adapter's KV blocks are named apart from
the base model's and from another adapter's; adapters the engine cannot serve are refused
with why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from cluster.lora import LoraError, LoraRef, parse_lora_modules, read_adapter
from kvbm.protocol import Sampling, model_namespace
from tasks.settings import engine_config
from tests.lora_util import peft_greedy, write_adapter
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.lora import LoraCache

MAX_TOKENS = 12
PROMPTS = [
    [1, 78, 183, 256, 279, 154, 50, 268, 428, 158, 111, 366],
    [1] + [(7 * i) % 500 + 5 for i in range(40)],  # chunked: prefill steps of 32 tokens
    [1, 5, 6, 7],
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora")
    return {
        # the text model's seven projections (PEFT's pattern form), rank 8
        "ad1": write_adapter(tiny_model_dir, d / "ad1", seed=1),
        # three projections by name (PEFT's list form: it adapts the vision tower's q/v
        # too, which the engine leaves out), rank 4, rsLoRA's scale
        "ad2": write_adapter(tiny_model_dir, d / "ad2", seed=2, r=4, alpha=8,
                             targets=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    }  # fmt: skip


def _run(
    engine: Engine, reqs: list[EngineRequest], waves: int = 3
) -> dict[str, list[RequestOutput]]:
    """Add ``reqs`` in ``waves`` groups two steps apart, run to the end; outputs by id."""
    outs: dict[str, list[RequestOutput]] = {}
    size = -(-len(reqs) // waves)
    for w in range(waves):
        for r in reqs[w * size : (w + 1) * size]:
            refused = engine.add_request(r)
            assert refused is None, refused
        for _ in range(2):
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    while engine.has_unfinished:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _req(rid: str, prompt: list[int], lora: LoraRef | None) -> EngineRequest:
    params = Sampling(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return EngineRequest(rid, prompt, params, lora=lora)


def test_engine_equals_peft_generate_with_adapters_mixed_in_a_batch(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    want = {name: peft_greedy(tiny_model_dir, path, PROMPTS, MAX_TOKENS)
            for name, path in [("base", None), *adapters.items()]}  # fmt: skip
    # each adapter changes the output: the comparison below is not the base model's twice
    assert want["ad1"] != want["base"] and want["ad2"] != want["base"]
    assert want["ad1"] != want["ad2"]
    config = engine_config(num_kv_blocks=256, max_num_batched_tokens=32)
    engine = Engine.from_model_dir(tiny_model_dir, config)
    refs = {"base": None} | {n: LoraRef(name=n, path=str(p)) for n, p in adapters.items()}
    reqs = [_req(f"{name}-{i}", p, ref) for i, p in enumerate(PROMPTS)
            for name, ref in refs.items()]  # fmt: skip
    outs = _run(engine, reqs)
    got = {name: [[t for o in outs[f"{name}-{i}"] for t in o.token_ids]
                  for i in range(len(PROMPTS))] for name in refs}  # fmt: skip
    assert got == want
    assert len(engine.loras) == 2
    assert engine.stats().blocks_used == 0


def test_an_adapters_blocks_are_named_apart(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = Engine.from_model_dir(
        tiny_model_dir, engine_config(num_kv_blocks=64, max_model_len=512)
    )
    ad1 = LoraRef(name="ad1", path=str(adapters["ad1"]))
    ad2 = LoraRef(name="ad2", path=str(adapters["ad2"]))
    prompt = PROMPTS[1]  # 41 tokens: two full blocks of 16
    cached = []
    for i, lora in enumerate([None, ad1, ad1, ad2, None]):
        outs = _run(engine, [_req(f"r{i}", prompt, lora)], waves=1)
        cached.append(outs[f"r{i}"][-1].num_cached_tokens)
    # the base model's blocks serve the base model only, and ad1's ad1 only
    assert cached == [0, 0, 32, 0, 32]
    assert model_namespace("m", "ad1") not in (model_namespace("m"), model_namespace("m", "ad2"))
    assert model_namespace("m", "ad1") == model_namespace("m", "ad1")


def test_an_adapter_for_another_model_fails_its_request_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(other)
    bad = write_adapter(other, tmp_path / "bad", seed=3, targets=["q_proj"])
    engine = Engine.from_model_dir(
        tiny_model_dir, engine_config(num_kv_blocks=64, max_model_len=512)
    )
    out = engine.add_request(_req("x", PROMPTS[0], LoraRef(name="bad", path=str(bad))))
    assert out is not None and out.finished and out.error_code == "invalid_lora_adapter"
    assert out.error_param == "model" and "model needs" in (out.error or "")
    missing = engine.add_request(_req("y", PROMPTS[0], LoraRef(name="gone", path=str(tmp_path))))
    assert missing is not None and "adapter_config.json" in (missing.error or "")
    outs = _run(engine, [_req("z", PROMPTS[0], None)], waves=1)  # the engine goes on
    assert outs["z"][-1].finish_reason == "length"


def test_the_cache_keeps_max_loras_and_reloads_a_moved_adapter(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = Engine.from_model_dir(
        tiny_model_dir, engine_config(num_kv_blocks=64, max_model_len=512)
    )
    cache = LoraCache(engine.model.w, max_loras=1, max_rank=16)
    a1 = cache.get(LoraRef(name="ad1", path=str(adapters["ad1"])))
    assert cache.get(LoraRef(name="ad1", path=str(adapters["ad1"]))) is a1
    cache.get(LoraRef(name="ad2", path=str(adapters["ad2"])))
    assert len(cache) == 1  # ad1 went first
    again = cache.get(LoraRef(name="ad1", path=str(adapters["ad1"])))
    assert again is not a1 and again.rank == 8 and abs(again.scale - 2.0) < 1e-9
    moved = cache.get(LoraRef(name="ad1", path=str(adapters["ad2"])))  # re-registered
    assert moved.rank == 4 and abs(moved.scale - 8 / 2) < 1e-9  # rsLoRA: alpha / sqrt(r)


# ------------------------------------------------------------------ adapter_config.json
def _adapter_dir(d: Path, **cfg: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (d / "adapter_config.json").write_text(json.dumps(base | cfg))
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


@pytest.mark.parametrize(("cfg", "why"), [
    ({"r": 32}, "above max_lora_rank=16"),
    ({"r": 0}, "positive integer"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"peft_type": "PREFIX_TUNING"}, "only LoRA"),
])  # fmt: skip
def test_adapters_the_engine_cannot_serve_are_refused(tmp_path: Path, cfg: dict, why: str) -> None:
    with pytest.raises(LoraError, match=why):
        read_adapter(_adapter_dir(tmp_path / "a", **cfg), max_rank=16)


def test_adapter_config_is_read(tmp_path: Path) -> None:
    got = read_adapter(_adapter_dir(tmp_path / "a", r=4, lora_alpha=8, use_rslora=True), 16)
    assert (got.rank, got.scale, got.target_modules) == (4, 4.0, ("q_proj",))
    with pytest.raises(LoraError, match="no adapter_config.json"):
        read_adapter(tmp_path / "nowhere", 16)
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="no adapter weights"):
        read_adapter(tmp_path / "a", 16)


def test_lora_modules_setting() -> None:
    assert parse_lora_modules(None) == []
    assert parse_lora_modules("a=/x, b=/y") == [LoraRef(name="a", path="/x"),
                                                LoraRef(name="b", path="/y")]  # fmt: skip
    assert parse_lora_modules('[{"name": "sql", "path": "/m/sql"}]') == [
        LoraRef(name="sql", path="/m/sql")]  # fmt: skip
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules("a")
    with pytest.raises(ValueError, match="JSON list"):
        parse_lora_modules('[{"name": "a"}]')
    with pytest.raises(LoraError, match="adapter name"):
        parse_lora_modules("b!d=/x")
