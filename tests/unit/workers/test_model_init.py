"""The generated default checkpoint: deterministic, small, loadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.checkpoint import TextModelConfig, load_text_weights
from workers.model_init import (
    BOS,
    EOS,
    IMAGE,
    PRESETS,
    TinyModelSpec,
    init_model,
    is_model_dir,
    spec_for_preset,
)

FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def test_two_runs_are_byte_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again")
    assert {p.name for p in tiny_model_dir.iterdir()} == FILES
    assert {p.name for p in again.iterdir()} == FILES
    for name in sorted(FILES):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_different_seed_changes_weights_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = init_model(tmp_path / "other", TinyModelSpec(seed=99))
    for name in sorted(FILES - {"model.safetensors"}):
        assert (other / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()


def test_size_under_10mb(tiny_model_dir: Path) -> None:
    total = sum(p.stat().st_size for p in tiny_model_dir.iterdir())
    assert total < 10 * 1024 * 1024


def test_text_config(tiny_model_dir: Path) -> None:
    assert is_model_dir(tiny_model_dir)
    cfg = TextModelConfig.from_dir(tiny_model_dir)
    spec = TinyModelSpec()
    assert cfg.vocab_size == spec.vocab_size == 512
    assert (cfg.hidden_size, cfg.intermediate_size) == (128, 352)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 4, 32)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 2048
    assert cfg.bos_token_id == BOS and cfg.eos_token_ids == [EOS]
    assert not cfg.tie_word_embeddings


def test_text_weights_normalised(tiny_model_dir: Path) -> None:
    w = load_text_weights(tiny_model_dir)
    assert len(w) == 3 + 9 * 4  # embed, norm, lm_head + 9 per layer; no vision tensors
    assert all(k.startswith(("model.", "lm_head.")) for k in w)
    assert not any("vision" in k or "projector" in k for k in w)
    assert w["model.embed_tokens.weight"].shape == (512, 128)
    assert w["model.layers.3.self_attn.k_proj.weight"].shape == (128, 128)


def test_gqa_spec(tmp_path: Path) -> None:
    d = init_model(
        tmp_path / "gqa",
        TinyModelSpec(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, seed=7),
    )
    cfg = TextModelConfig.from_dir(d)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 16)
    w = load_text_weights(d)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (32, 128)
    assert w["model.layers.1.self_attn.q_proj.weight"].shape == (128, 128)


def test_loads_in_transformers(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    assert cfg.model_type == "llava"
    assert cfg.text_config.num_key_value_heads == 4
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok("hi").input_ids[0] == BOS
    assert (tok.eos_token_id, tok.pad_token_id) == (EOS, 3)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_generation_config(tiny_model_dir: Path) -> None:
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def test_processor_expands_images(tiny_model_dir: Path) -> None:
    """AutoProcessor loads the default model: a LlavaProcessor whose CLIP image processor
    gives the tower's 32x32 pixels (any size and mode in) and whose text side turns each
    <image> into image_seq_length placeholder tokens; its chat template renders an image
    part as <image>."""
    transformers = pytest.importorskip("transformers")
    image_mod = pytest.importorskip("PIL.Image")
    proc = transformers.AutoProcessor.from_pretrained(tiny_model_dir)
    assert type(proc).__name__ == "LlavaProcessor"
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["image_seq_length"] == 16 == TinyModelSpec().image_seq_length
    images = [image_mod.new("RGBA", (50, 20), (9, 8, 7, 6)), image_mod.new("L", (7, 90), 200)]
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]}]  # fmt: skip
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\na<image>b<image></s>\n<|assistant|>\n"
    out = proc(text=text, images=images, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids.count(IMAGE) == 2 * 16
    first = ids.index(IMAGE)
    assert ids[first : first + 16] == [IMAGE] * 16 and ids[first + 16] != IMAGE
    assert tuple(out["pixel_values"].shape) == (2, 3, 32, 32)
    # the tokenizer alone renders the same prompt
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == text


def test_preset_llava_15_like(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = spec_for_preset("llava-1.5-like")
    assert spec is PRESETS["llava-1.5-like"]
    d = init_model(tmp_path / "l15", spec)
    cfg = transformers.AutoConfig.from_pretrained(d)
    assert (cfg.vision_config.image_size, cfg.vision_config.patch_size) == (336, 14)
    assert cfg.image_seq_length == 576
    assert cfg.text_config.hidden_size >= TinyModelSpec().hidden_size
    proc = transformers.AutoProcessor.from_pretrained(d)
    image_mod = pytest.importorskip("PIL.Image")
    out = proc(text="x<image>y", images=[image_mod.new("RGB", (640, 480))], return_tensors="pt")
    assert out["input_ids"][0].tolist().count(IMAGE) == 576
    assert tuple(out["pixel_values"].shape) == (1, 3, 336, 336)
    with pytest.raises(ValueError, match="llava-1.5-like"):
        spec_for_preset("huge")


@pytest.mark.parametrize(("preset", "labels"), [("classifier", ["negative", "positive"]),
                                                ("reranker", ["LABEL_0"])])  # fmt: skip
def test_classifier_presets(preset: str, labels: list[str], tmp_path: Path) -> None:
    """A sequence classifier: the llama preset's text model, a score head in place of the
    LM head, loaded by transformers as LlamaForSequenceClassification."""
    transformers = pytest.importorskip("transformers")
    d = init_model(tmp_path / preset, PRESETS[preset])
    lm = init_model(tmp_path / "llama", PRESETS["llama"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(d)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert [model.config.id2label[i] for i in range(len(labels))] == labels
    w, lm_w = load_text_weights(d), load_text_weights(lm)
    assert tuple(w.pop("score.weight").shape) == (len(labels), 128)
    assert "lm_head.weight" not in w and lm_w.pop("lm_head.weight") is not None
    assert w.keys() == lm_w.keys() and all((w[k] == lm_w[k]).all() for k in w)
    with pytest.raises(ValueError, match="text only"):
        init_model(tmp_path / "bad", TinyModelSpec(num_labels=2))
