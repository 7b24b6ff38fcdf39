"""api.classifier: which checkpoints are sequence classifiers, their labels, and the
activation chosen as vLLM chooses it (problem_type, then a cross-encoder's
sentence-transformers activation_fn, then softmax / sigmoid by the number of labels)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from api.classifier import Classifier, load_classifier

ST = "torch.nn.modules."


def _dir(tmp_path: Path, **config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_only_a_sequence_classifier_has_a_head(tmp_path: Path) -> None:
    assert load_classifier(_dir(tmp_path, architectures=["LlamaForCausalLM"])) is None
    assert load_classifier(_dir(tmp_path)) is None
    c = load_classifier(_dir(tmp_path, architectures=["Qwen2ForSequenceClassification"],
                             id2label={"0": "no", "1": "yes", "2": "maybe"}))  # fmt: skip
    assert c == Classifier("Qwen2ForSequenceClassification", ("no", "yes", "maybe"), "softmax")
    # Hugging Face's defaults: two labels, LABEL_i; num_labels without id2label
    arch = ["LlamaForSequenceClassification"]
    assert load_classifier(_dir(tmp_path, architectures=arch)).labels == ("LABEL_0", "LABEL_1")  # type: ignore[union-attr]
    one = load_classifier(_dir(tmp_path, architectures=arch, num_labels=1))
    assert one is not None and (one.num_labels, one.activation) == (1, "sigmoid")
    assert one.sep_pair
    no_sep = load_classifier(_dir(tmp_path, architectures=arch, use_sep_token=False))
    assert no_sep is not None and not no_sep.sep_pair


@pytest.mark.parametrize(("extra", "n", "want"), [
    ({"problem_type": "regression"}, 2, "identity"),
    ({"problem_type": "multi_label_classification"}, 3, "sigmoid"),
    ({"problem_type": "single_label_classification"}, 3, "softmax"),
    ({"problem_type": "single_label_classification"}, 1, "sigmoid"),
    ({"sentence_transformers": {"activation_fn": ST + "linear.Identity"}}, 1, "identity"),
    ({"sentence_transformers": {"activation_fn": ST + "activation.Sigmoid"}}, 1, "sigmoid"),
    ({"sbert_ce_default_activation_function": ST + "activation.Tanh"}, 1, "tanh"),
    # problem_type wins over a sentence-transformers activation
    ({"problem_type": "regression",
      "sentence_transformers": {"activation_fn": ST + "activation.Sigmoid"}}, 1, "identity"),
])  # fmt: skip
def test_the_activation_is_vllms_choice(tmp_path: Path, extra: dict, n: int, want: str) -> None:
    c = load_classifier(_dir(tmp_path, architectures=["LlamaForSequenceClassification"],
                             num_labels=n, **extra))  # fmt: skip
    assert c is not None and c.activation == want


def test_an_activation_not_computed_here_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GELU"):
        gelu = {"activation_fn": ST + "activation.GELU"}
        arch = ["LlamaForSequenceClassification"]
        load_classifier(_dir(tmp_path, architectures=arch, sentence_transformers=gelu))


def test_activate() -> None:
    logits = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    soft = Classifier("X", ("a", "b", "c"), "softmax").activate(logits)
    np.testing.assert_allclose(soft, np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)
    assert abs(soft.sum() - 1) < 1e-12
    sig = Classifier("X", ("a", "b", "c"), "sigmoid").activate(logits)
    np.testing.assert_allclose(sig, 1 / (1 + np.exp(-logits.astype(np.float64))))
    np.testing.assert_allclose(Classifier("X", ("a",) * 3, "tanh").activate(logits),
                               np.tanh(logits), rtol=1e-6)  # fmt: skip
    raw = Classifier("X", ("a", "b", "c"), "softmax").activate(logits, use_activation=False)
    np.testing.assert_array_equal(raw, logits)
    big = Classifier("X", ("a", "b"), "softmax").activate(np.array([1000.0, 0.0]))
    np.testing.assert_allclose(big, [1.0, 0.0])  # no overflow
