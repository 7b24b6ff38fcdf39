"""The plain-torch vision encoder equals Hugging Face's LLaVA image features.

Reference: ``LlavaForConditionalGeneration.model.get_image_features`` on the same checkpoint
and the same pixel values (which :meth:`VisionEncoder.preprocess` must give exactly as
``AutoProcessor`` does). Checkpoints: the default tiny model, the ``llava-1.5-like`` preset,
variants of the feature selection (a list of layers, the "full" strategy, the last layer,
another projector activation), and the transformers 5 weight layout.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from workers.model_init import PRESETS, TinyModelSpec, init_model
from workers.vision import VisionConfig, VisionEncoder

ATOL = 1e-5


def _images() -> list[Image.Image]:
    """Different sizes and modes, some through an encoder and back."""
    gen = torch.Generator().manual_seed(3)

    def noise(w: int, h: int, c: int) -> torch.Tensor:
        return torch.randint(0, 256, (h, w, c), generator=gen, dtype=torch.uint8)

    rgb = Image.fromarray(noise(640, 480, 3).numpy(), "RGB")
    rgba = Image.fromarray(noise(33, 70, 4).numpy(), "RGBA")
    gray = Image.fromarray(noise(5, 3, 1).squeeze(-1).numpy(), "L")
    buf = io.BytesIO()
    rgb.resize((90, 60)).save(buf, format="JPEG", quality=80)
    jpeg = Image.open(io.BytesIO(buf.getvalue()))
    return [rgb, rgba, gray, jpeg]


def _hf_features(model_dir: Path, pixels: torch.Tensor) -> torch.Tensor:
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=pixels)
    return torch.stack(list(out.pooler_output))


def _check_against_hf(model_dir: Path, images: list[Image.Image]) -> torch.Tensor:
    enc = VisionEncoder.from_model_dir(model_dir)
    pixels = enc.preprocess(images)
    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    want_pixels = proc(text="<image>" * len(images), images=images, return_tensors="pt")
    assert torch.equal(pixels, want_pixels["pixel_values"])
    got = enc.encode(pixels)
    want = _hf_features(model_dir, pixels)
    assert got.shape == (len(images), enc.image_seq_length, enc.hidden_size) == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert want.abs().max() > 0.1  # not trivially equal
    return got


def test_default_model_matches_hf(tiny_model_dir: Path) -> None:
    got = _check_against_hf(tiny_model_dir, _images())
    assert got.shape == (4, 16, 128)
    # different images give different embeddings
    assert not torch.allclose(got[0], got[1], atol=1e-3)


def test_batch_equals_one_at_a_time(tiny_model_dir: Path) -> None:
    enc = VisionEncoder.from_model_dir(tiny_model_dir)
    pixels = enc.preprocess(_images())
    batch = enc.encode(pixels)
    for i in range(pixels.shape[0]):
        torch.testing.assert_close(enc.encode(pixels[i : i + 1])[0], batch[i], atol=ATOL, rtol=0)


def test_preset_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = init_model(tmp_path_factory.mktemp("models") / "l15", PRESETS["llava-1.5-like"])
    got = _check_against_hf(d, _images()[:2])
    assert got.shape == (2, 576, 256)


@pytest.mark.parametrize(
    "variant",
    [
        dict(vision_feature_layer=(-1, 0, -2)),
        dict(vision_feature_select_strategy="full", projector_hidden_act="quick_gelu"),
        dict(vision_feature_layer=-1, vision_layers=3, vision_heads=2),
        dict(vision_feature_layer=(1, -1), vision_feature_select_strategy="full"),
    ],
    ids=["layer-list", "full", "last-layer", "list-full"],
)
def test_feature_selection_matches_hf(tmp_path: Path, variant: dict) -> None:
    d = init_model(tmp_path / "m", TinyModelSpec(**variant, seed=5))
    spec = TinyModelSpec(**variant)
    enc = VisionEncoder.from_model_dir(d)
    assert enc.image_seq_length == spec.image_seq_length
    assert enc.image_seq_length == (17 if spec.vision_feature_select_strategy == "full" else 16)
    _check_against_hf(d, _images()[:3])


def test_transformers5_layout(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Weights named ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` (as
    transformers 5 holds them) load into the same encoder."""
    d = tmp_path / "t5"
    shutil.copytree(tiny_model_dir, d)
    hub = load_file(str(d / "model.safetensors"))
    renamed = {}
    for name, t in hub.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model.") :]
        else:
            name = "model." + name
        renamed[name] = t
    assert any(k.startswith("model.vision_tower.vision_model.") for k in renamed)
    save_file(renamed, str(d / "model.safetensors"), metadata={"format": "pt"})
    ref = VisionEncoder.from_model_dir(tiny_model_dir)
    enc = VisionEncoder.from_model_dir(d)
    assert enc.w.keys() == ref.w.keys()
    pixels = ref.preprocess(_images())
    assert torch.equal(enc.encode(pixels), ref.encode(pixels))


def test_bad_inputs(tiny_model_dir: Path, tmp_path: Path) -> None:
    enc = VisionEncoder.from_model_dir(tiny_model_dir)
    with pytest.raises(ValueError, match="pixel_values must be"):
        enc.encode(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="at least one image"):
        enc.preprocess([])
    with pytest.raises(ValueError, match="dtype"):
        VisionEncoder.from_model_dir(tiny_model_dir, dtype="float64")
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ValueError, match="no vision_config"):
        VisionConfig.from_dir(text_only)


def test_bfloat16_close_to_float32(tiny_model_dir: Path) -> None:
    f32 = VisionEncoder.from_model_dir(tiny_model_dir)
    bf16 = VisionEncoder.from_model_dir(tiny_model_dir, dtype="bfloat16")
    pixels = f32.preprocess(_images()[:2])
    out = bf16.encode(pixels)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), f32.encode(pixels), atol=0.1, rtol=0.05)
