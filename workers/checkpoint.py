"""Read a Hugging Face model directory: the text model's config and its weights.

Handles plain Llama-family checkpoints (``LlamaForCausalLM``, Mistral-style configs) and
LLaVA-style checkpoints whose text model sits under ``text_config`` with prefixed weight
names — both the hub layout (``language_model.model.*``) and the transformers 5 layout
(``model.language_model.*``). Weight names are normalised to the plain Llama layout
(``model.layers.N.*``, ``model.embed_tokens``, ``model.norm``, ``lm_head``). A sequence
classifier (``LlamaForSequenceClassification`` and the like) has its head, ``score``,
where a causal LM has ``lm_head``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from kvbm.protocol import eos_token_ids

if TYPE_CHECKING:  # the config part is read by torch-free code (the mock engine)
    import torch

_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


@dataclass(slots=True)
class TextModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextModelConfig:
        d = Path(model_dir)
        raw = json.loads((d / "config.json").read_text())
        tc = raw.get("text_config", raw)
        heads = tc["num_attention_heads"]
        hidden = tc["hidden_size"]
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        rope_theta = float(tc.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        supported = ("default", "linear", "llama3")
        if rope_type not in supported:
            raise ValueError(f"rope_type {rope_type!r} not supported; supported: {supported}")
        tie = bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
        eos = eos_token_ids(d)
        act = tc.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} not supported; supported: silu")
        return cls(
            vocab_size=tc["vocab_size"],
            hidden_size=hidden,
            intermediate_size=tc["intermediate_size"],
            num_layers=tc["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=tc.get("num_key_value_heads") or heads,
            head_dim=tc.get("head_dim") or hidden // heads,
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=tc.get("max_position_embeddings", 2048),
            rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            tie_word_embeddings=tie,
            attention_bias=bool(tc.get("attention_bias", False)),
            mlp_bias=bool(tc.get("mlp_bias", False)),
            hidden_act=act,
            bos_token_id=tc.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos,
        )


def is_model_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like a Hugging Face checkpoint directory."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def load_text_weights(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """All text-model tensors of the checkpoint, renamed to the plain Llama layout
    (``dtype`` default: float32)."""
    import torch

    dtype = dtype or torch.float32
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                plain = plain_name(name)
                if plain is None:
                    continue
                out[plain] = fh.get_tensor(name).to(device=device, dtype=dtype)
    return out


def plain_name(name: str) -> str | None:
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    # score.*: a *ForSequenceClassification's head (in place of lm_head)
    if name.startswith(("model.", "lm_head.", "score.")) and not name.startswith(
        ("model.vision_tower.", "model.multi_modal_projector.")
    ):
        return name
    return None  # vision tower / projector: not part of the text model
