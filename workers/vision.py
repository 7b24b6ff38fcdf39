"""The LLaVA image encoder in plain torch: a CLIP vision tower and the multi-modal projector.

:class:`VisionEncoder` turns images into the rows the text model reads at an image's
placeholder tokens, ``[n_images, image_seq_length, text_hidden]``, as Hugging Face's
``LlavaModel.get_image_features`` computes them: CLIP patch + class + position embeddings,
``pre_layrnorm``, pre-norm encoder layers (SDPA attention, ``hidden_act`` MLP), the hidden
state of ``vision_feature_layer`` (an int, or a list whose states are concatenated), the CLS
row dropped under ``vision_feature_select_strategy="default"``, then ``linear_1 → act →
linear_2``. Layers past the deepest selected one are not run (their output is unused).

Images are turned into pixel values by the model directory's own image processor
(``preprocessor_config.json``, loaded with ``transformers.AutoImageProcessor``), so the
encoder sees exactly the pixels Hugging Face's ``AutoProcessor`` gives the model.

Weights come from the checkpoint in either layout: the hub's (``vision_tower.vision_model.*``,
``multi_modal_projector.*``) or transformers 5's (``model.vision_tower.vision_model.*``,
``model.multi_modal_projector.*``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open

if TYPE_CHECKING:
    from PIL.Image import Image

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_STRATEGIES = ("default", "full")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# Hugging Face activation names (transformers.activations.ACT2FN) this encoder runs.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass(slots=True)
class VisionConfig:
    """What the encoder needs of a LLaVA ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: list[int]  # hidden-state indices (0 = embeddings), non-negative
    concat_features: bool  # vision_feature_layer was a list: concatenate their states
    select_strategy: str  # "default" drops the CLS row, "full" keeps it
    projector_act: str
    text_hidden_size: int
    image_token_index: int

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> VisionConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        vc = raw.get("vision_config")
        if vc is None:
            raise ValueError(f"{model_dir} has no vision_config: not a vision-language model")
        vtype = vc.get("model_type", "clip_vision_model")
        if vtype != "clip_vision_model":
            raise ValueError(f"vision tower {vtype!r} not supported; supported: clip_vision_model")
        layers = vc["num_hidden_layers"]
        raw_layer = raw.get("vision_feature_layer", -2)
        wanted = raw_layer if isinstance(raw_layer, list) else [raw_layer]
        feature_layers = []
        for i in wanted:  # hidden_states has layers + 1 entries (the embeddings first)
            if not -(layers + 1) <= i <= layers:
                raise ValueError(f"vision_feature_layer {i} out of range for {layers} layers")
            feature_layers.append(i % (layers + 1))
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in _STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r}; allowed: {_STRATEGIES}")
        acts = (vc.get("hidden_act", "quick_gelu"), raw.get("projector_hidden_act", "gelu"))
        for act in acts:
            if act not in _ACTIVATIONS:
                allowed = list(_ACTIVATIONS)
                raise ValueError(f"activation {act!r} not supported; supported: {allowed}")
        tc = raw.get("text_config", {})
        return cls(
            hidden_size=vc["hidden_size"],
            intermediate_size=vc["intermediate_size"],
            num_layers=layers,
            num_heads=vc["num_attention_heads"],
            image_size=vc["image_size"],
            patch_size=vc["patch_size"],
            num_channels=vc.get("num_channels", 3),
            layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
            hidden_act=acts[0],
            feature_layers=feature_layers,
            concat_features=isinstance(raw_layer, list),
            select_strategy=strategy,
            projector_act=acts[1],
            text_hidden_size=tc["hidden_size"],
            image_token_index=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_seq_length(self) -> int:
        """Placeholder tokens (and embedding rows) per image."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)


class VisionEncoder:
    """CLIP vision tower + LLaVA projector; stateless apart from its weights."""

    def __init__(
        self,
        cfg: VisionConfig,
        weights: dict[str, torch.Tensor],
        image_processor: Callable[..., object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        self.image_processor = image_processor
        self.dtype = weights["embeddings.patch_embedding.weight"].dtype
        self.device = weights["embeddings.patch_embedding.weight"].device
        self._run_layers = max(cfg.feature_layers)  # encoder layers worth running
        self._act = _ACTIVATIONS[cfg.hidden_act]
        self._proj_act = _ACTIVATIONS[cfg.projector_act]

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, dtype: str = "float32", device: str = "cpu"
    ) -> VisionEncoder:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; supported: {list(_DTYPES)}")
        from transformers import AutoImageProcessor  # workers may use it to preprocess

        d = Path(model_dir)
        cfg = VisionConfig.from_dir(d)
        weights = load_vision_weights(d, _DTYPES[dtype], device)
        return cls(cfg, weights, AutoImageProcessor.from_pretrained(str(d)))

    @property
    def image_seq_length(self) -> int:
        return self.cfg.image_seq_length

    @property
    def hidden_size(self) -> int:
        """Width of an embedding row: the text model's hidden size."""
        return self.cfg.text_hidden_size

    # ----------------------------------------------------------------------------------
    def preprocess(self, images: list[Image]) -> torch.Tensor:
        """Pixel values ``[n, channels, image_size, image_size]`` (float32) by the model's
        own image processor: what ``AutoProcessor`` hands Hugging Face's model."""
        if self.image_processor is None:
            raise ValueError("this encoder was built without an image processor")
        if not images:
            raise ValueError("preprocess needs at least one image")
        out = self.image_processor(images=images, return_tensors="pt")
        pixels = out["pixel_values"]  # type: ignore[index]
        size = self.cfg.image_size
        assert pixels.shape[1:] == (self.cfg.num_channels, size, size), (
            f"the image processor made {tuple(pixels.shape)}; the vision tower takes "
            f"{size}x{size}: preprocessor_config.json disagrees with config.json"
        )
        return pixels

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[n, image_seq_length, text_hidden]`` of a batch of images, in one
        forward pass."""
        cfg, w = self.cfg, self.w
        if pixel_values.dim() != 4 or pixel_values.shape[2:] != (cfg.image_size,) * 2:
            raise ValueError(
                f"pixel_values must be [n, {cfg.num_channels}, {cfg.image_size}, "
                f"{cfg.image_size}], got {tuple(pixel_values.shape)}"
            )
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        patches = F.conv2d(x, w["embeddings.patch_embedding.weight"], stride=cfg.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [n, patches, hidden]
        cls_row = w["embeddings.class_embedding"].expand(x.shape[0], 1, -1)
        h = torch.cat([cls_row, patches], dim=1) + w["embeddings.position_embedding.weight"]
        h = self._layer_norm(h, "pre_layrnorm")
        states = {0: h}
        for layer in range(self._run_layers):
            h = self._encoder_layer(h, f"encoder.layers.{layer}.")
            states[layer + 1] = h
        picked = [states[i] for i in cfg.feature_layers]
        if cfg.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]
        feats = torch.cat(picked, dim=-1) if cfg.concat_features else picked[0]
        out = F.linear(feats, w["projector.linear_1.weight"], w.get("projector.linear_1.bias"))
        out = self._proj_act(out)
        return F.linear(out, w["projector.linear_2.weight"], w.get("projector.linear_2.bias"))

    # ----------------------------------------------------------------------------------
    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w
        return F.layer_norm(x, (x.shape[-1],), w[name + ".weight"], w[name + ".bias"],
                            self.cfg.layer_norm_eps)  # fmt: skip

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _encoder_layer(self, h: torch.Tensor, p: str) -> torch.Tensor:
        n, t, d = h.shape
        heads = self.cfg.num_heads
        x = self._layer_norm(h, p + "layer_norm1")
        q, k, v = (
            self._linear(x, p + f"self_attn.{proj}").view(n, t, heads, d // heads).transpose(1, 2)
            for proj in ("q_proj", "k_proj", "v_proj")
        )
        o = F.scaled_dot_product_attention(q, k, v)  # bidirectional; scale 1/sqrt(head_dim)
        h = h + self._linear(o.transpose(1, 2).reshape(n, t, d), p + "self_attn.out_proj")
        x = self._layer_norm(h, p + "layer_norm2")
        x = self._linear(self._act(self._linear(x, p + "mlp.fc1")), p + "mlp.fc2")
        return h + x


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def load_vision_weights(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The vision tower's tensors (names relative to ``vision_model.``) and the projector's
    (``projector.linear_1.*``, ``projector.linear_2.*``), from either checkpoint layout."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                short = _short_name(name)
                if short is not None:
                    out[short] = fh.get_tensor(name).to(device=device, dtype=dtype)
    for need in ("embeddings.patch_embedding.weight", "projector.linear_1.weight"):
        if need not in out:
            raise ValueError(f"{d} has no {need}: not a LLaVA checkpoint with a CLIP tower")
    return out


def _short_name(name: str) -> str | None:
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "projector." + name[len(prefix) :]
    return None
