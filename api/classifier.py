"""The served model's classification head, as the API sees it: whether the checkpoint is a
sequence classifier (a ``*ForSequenceClassification``: ``/classify``, and a cross-encoder's
``/score`` and ``/rerank``), its labels, and the activation its logits go through.

The engine returns a classification's raw logits (:class:`kvbm.protocol.Pooling` with
``task`` classify); the activation is applied here, chosen from the checkpoint's
``config.json`` as vLLM chooses it (in the order of Hugging Face's
``ForSequenceClassification`` loss): ``problem_type`` ``regression`` none,
``multi_label_classification`` a sigmoid per label, ``single_label_classification`` a
softmax; else a cross-encoder's sentence-transformers ``activation_fn`` (or
``sbert_ce_default_activation_function``); else a softmax over two or more labels and a
sigmoid for one. A request's ``use_activation: false`` keeps the raw logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# sentence-transformers' activation_fn (a torch.nn module's path) -> ours; "classify":
# softmax over two or more labels, sigmoid for one (vLLM treats Sigmoid and Softmax so)
_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclass(frozen=True, slots=True)
class Classifier:
    """A sequence classifier's head (what ``config.json`` says of it)."""

    architecture: str
    labels: tuple[str, ...]  # label i's name (id2label; Hugging Face's LABEL_i without one)
    activation: str  # softmax | sigmoid | identity | tanh
    # a scored pair is the tokenizer's text pair (its separator between them), as
    # vLLM's use_sep_token; False: the two texts concatenated (an LLM used as a reranker)
    sep_pair: bool = True

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def activate(self, logits: np.ndarray, use_activation: bool | None = None) -> np.ndarray:
        """The head's output for one input's ``logits`` (``use_activation`` False: as is)."""
        x = logits.astype(np.float64)
        if use_activation is False or self.activation == "identity":
            return x
        if self.activation == "sigmoid":
            return 1.0 / (1.0 + np.exp(-x))
        if self.activation == "tanh":
            return np.tanh(x)
        e = np.exp(x - x.max())
        return e / e.sum()


def load_classifier(model_dir: str | Path) -> Classifier | None:
    """The checkpoint's classification head; None for a model that is not a sequence
    classifier. ``ValueError`` for an activation this server does not compute."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    arch = next((a for a in raw.get("architectures") or []
                 if a.endswith("ForSequenceClassification")), None)  # fmt: skip
    if arch is None:
        return None
    id2label = raw.get("id2label") or {}
    n = len(id2label) if id2label else int(raw.get("num_labels", 2))  # HF's default: 2
    labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(n))
    sep = raw.get("use_pad_token", raw.get("use_sep_token", True))  # the older name first
    return Classifier(arch, labels, _activation(raw, n), bool(sep))


def _activation(raw: dict, num_labels: int) -> str:
    classify = "softmax" if num_labels >= 2 else "sigmoid"
    problem = raw.get("problem_type") or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return classify
    fn = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function")  # fmt: skip
    if fn is None:
        return classify
    if fn not in _ST_ACTIVATIONS:
        raise ValueError(f"the checkpoint's activation_fn {fn!r} is not computed here; "
                         f"served: {', '.join(_ST_ACTIVATIONS)}")  # fmt: skip
    got = _ST_ACTIVATIONS[fn]
    return classify if got == "classify" else got
