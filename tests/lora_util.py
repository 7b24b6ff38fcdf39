"""LoRA adapters for tests, written by PEFT itself (``save_pretrained``), so the files are
what a user's fine-tuning run leaves: ``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's own key names."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# a LLaVA checkpoint's text model only: a list of names would also adapt the vision
# tower's attention (CLIP's q/k/v/out projections), which the engine runs without adapters
LLAVA_TEXT_PATTERN = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
)


def hf_model(model_dir: Path) -> torch.nn.Module:
    """The checkpoint as transformers loads it (LLaVA or plain Llama), in eval mode."""
    import json

    raw = json.loads((model_dir / "config.json").read_text())
    cls = (transformers.LlavaForConditionalGeneration if "vision_config" in raw
           else transformers.LlamaForCausalLM)  # fmt: skip
    return cls.from_pretrained(model_dir).eval()


def write_adapter(
    model_dir: Path, out: Path, seed: int, r: int = 8, alpha: float = 16,
    targets: list[str] | str | None = None, use_rslora: bool = False,
) -> Path:  # fmt: skip
    """A LoRA adapter for ``model_dir`` with random A and B (``seed``): PEFT's
    ``init_lora_weights=False``, so it changes the model's output at once."""
    torch.manual_seed(seed)
    base = hf_model(model_dir)
    raw_targets = targets if targets is not None else LLAVA_TEXT_PATTERN
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=raw_targets,
                          init_lora_weights=False, use_rslora=use_rslora,
                          lora_dropout=0.0)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # big enough updates that greedy tokens change
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out)
    return out


def peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]],
                max_tokens: int) -> list[list[int]]:  # fmt: skip
    """Hugging Face ``generate``'s greedy tokens for each prompt, alone (batch 1), through
    PEFT's own loading of ``adapter`` (None: the base model)."""
    model = hf_model(model_dir)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None)  # fmt: skip
            out.append(seq[0, len(p) :].tolist())
    return out
