"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from workers.checkpoint import TextModelConfig, load_text_weights
from workers.llama import LlamaModel


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir: Path) -> tuple[LlamaModel, Tokenizer]:
    """The tiny default model's text weights and its tokenizer (one load per module)."""
    cfg = TextModelConfig.from_dir(tiny_model_dir)
    model = LlamaModel(cfg, load_text_weights(tiny_model_dir))
    return model, Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
