"""Conveyor's wire contract: everything that crosses a process, named once. torch-free.

The API, the stage tasks and the workers' engine processes take their data-plane Redis
names (token channels, transfer keys), token frames, stage payloads and handles, and
block hashes from here; the cluster's own keys, queues and scripts are :mod:`cluster`'s.
Nothing matches the other side of a seam by convention.

Public part:
    keys and channels   tokens_channel, cancelled_key, kv_data_key, media_key, ... (a
                        function each, on cluster.keys's prefix)
    block hashing       block_hashes (chained, seeded, with per-block extra keys),
                        model_namespace, extra_keys_for_spans; images: image_extra_key,
                        image_spans, request_extra_keys
    media               media_key: an image's bytes in Redis, named by its content hash
    KV tiers            G1 / G2 / G3: what KV events and the index call the engine pool,
                        host memory and local disk
    TokenFrame          one frame of a token stream: built by a worker, parsed by the API
    Sampling            the sampling parameters a request carries to the engine (and
                        StructuredOutput, the grammar its output must follow)
    Pooling             what an embedding request asks of its pooled vector
    choices (n > 1)     choice_stream_id / choice_request_id: each choice's own stream;
                        choice_seed / choice_sampling: each choice's own seed
    ImageRef            one image of a prompt: its content hash and placeholder tokens
    StagePayload        what every stage task receives
    EncodeHandle        what an encode task hands the task that prefills (embeddings)
    PrefillHandle       what a prefill task hands its decode task (where the KV is)
    StageSummary        what a generate or decode task returns
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson
import xxhash
from pydantic import BaseModel, Field, model_validator

from cluster.keys import KEY_PREFIX
from cluster.lora import LoraRef

# ======================================================================================
# Redis keys and channels of the data plane (the cluster's own: cluster.keys)
# ======================================================================================
TOKENS_PREFIX = "tokens:"
CANCEL_CHANNEL = KEY_PREFIX + "cancel"  # PUBLISH request id: abort it wherever it runs


def tokens_channel(request_id: str) -> str:
    """The pub/sub channel a request's token frames travel on."""
    return TOKENS_PREFIX + request_id


def frames_key(request_id: str) -> str:
    """STREAM: the frames of ``request_id``'s stream, kept for a client that reconnects
    (``CONVEYOR_RESUMABLE_STREAMS``; :mod:`api.resume`). Each entry's ``f`` is a frame as
    published; an entry ``m`` (written by the API) says the stream moved on to that stream
    id (a migration), whose log goes on with the next frames."""
    return f"{KEY_PREFIX}frames:{request_id}"


FRAMES_MAXLEN = 100_000  # a request's frame log holds its frames: a cap, not a window
FRAMES_OPEN_TTL_S = 3600  # a log whose stream never ended (its worker died) goes in an hour


def cancelled_key(request_id: str) -> str:
    """Set when the API is done with a request: a copy the broker redelivers is skipped."""
    return f"{KEY_PREFIX}cancelled:{request_id}"


# KV cache tiers (the KVBM's G1 / G2 / G3), as KV events and the index name them
G1 = 1  # the engine's own pool (GPU memory, or the CPU pool of the reference engine)
G2 = 2  # host memory
G3 = 3  # local disk
TIERS = (G1, G2, G3)
TIER_NAMES = {G1: "g1", G2: "g2", G3: "g3"}


def kv_release_channel(worker_id: str) -> str:
    """A prefill worker hears here that a decode worker has pulled a request's KV."""
    return f"{KEY_PREFIX}kv-release:{worker_id}"


def kv_data_key(request_id: str, chunk: int) -> str:
    """The Redis KV transfer backend: one chunk of a request's exported blocks."""
    return f"{KEY_PREFIX}kvdata:{request_id}:{chunk}"


def embedding_key(request_id: str, image_hash: str) -> str:
    """The Redis transfer backend: one image's embedding, exported for one request."""
    return f"{KEY_PREFIX}emb:{request_id}:{image_hash}"


def embedding_release_channel(worker_id: str) -> str:
    """An encode worker hears here that a puller has read an embedding it staged."""
    return f"{KEY_PREFIX}emb-release:{worker_id}"


def nixl_agent_key(agent: str) -> str:
    """A NIXL agent's metadata, for peers to connect to it."""
    return f"{KEY_PREFIX}nixl:agent:{agent}"


def media_key(image_hash: str) -> str:
    """STRING: an image's bytes as the API fetched them (encoded: PNG, JPEG, ...), named by
    its content hash (:class:`ImageRef`), with a TTL; whoever encodes the image reads it
    here (image bytes never travel inside a Celery message)."""
    return f"{KEY_PREFIX}media:{image_hash}"


# ======================================================================================
# Block hashing
# ======================================================================================
# The hash of block i covers (the hash of block i-1, the token ids of block i, a namespace:
# the model, and a LoRA adapter's name, and the extra keys of block i: the content hash of
# an image whose placeholder tokens fall in it), so equal hashes mean equal prefixes. It is
# xxh3-64 with a fixed seed over a canonical byte encoding: the same value in the API and
# in every worker, on every machine (never Python's salted ``hash``). Only full blocks
# are hashed; a partial last block has no identity yet.
HASH_SEED = 0x5EED_C0DE
_HEAD = struct.Struct("<QQ")  # a block's parent hash and namespace
ROOT_PARENT = 0  # the parent of a sequence's first block

ExtraKeys = tuple[str, ...]  # one block's extra keys; () for none


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The checkpoint's end-of-sequence ids (generation_config.json wins over config.json,
    as in Hugging Face): what the engine stops on and the API's beam search ends beams on."""
    d = Path(model_dir)
    value = None
    gen = d / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        raw = json.loads((d / "config.json").read_text())
        value = raw.get("text_config", raw).get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def namespace_hash(*parts: str) -> int:
    """Fold namespace parts (model id, adapter id) into one 64-bit value."""
    return xxhash.xxh3_64_intdigest("\x1f".join(parts).encode(), seed=HASH_SEED)


def model_namespace(model_name: str, lora_name: str | None = None,
                    cache_salt: str | None = None) -> int:  # fmt: skip
    """The namespace of a served model's blocks: the API's router and every worker's block
    pool call this with the served model name (0 for none) and, for a request through a
    LoRA adapter, the adapter's name: its KV differs from the base model's for the same
    tokens, so its blocks are named apart (a prefix is shared only under one adapter).
    A request's ``cache_salt`` (vLLM's) names its blocks apart too: its prefix is shared
    only with requests of the same salt (and the same adapter)."""
    parts = [model_name, "lora", lora_name] if lora_name else [model_name]
    if cache_salt:
        parts += ["salt", cache_salt]
    if len(parts) > 1:
        return namespace_hash(*parts)
    return namespace_hash(model_name) if model_name else 0


def block_hash(
    parent: int, tokens: Sequence[int], namespace: int = 0, extra: ExtraKeys = ()
) -> int:
    """Hash of one full block given its parent block's hash."""
    payload = struct.pack(f"<QQ{len(tokens)}I", parent, namespace, *tokens)
    if extra:  # a block without extra keys hashes exactly as plain text always has
        payload += b"\x1e" + "\x1f".join(extra).encode()
    return xxhash.xxh3_64_intdigest(payload, seed=HASH_SEED)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: int = 0,
    extra_keys_per_block: Sequence[ExtraKeys] | None = None,
    start: int = 0,
    parent: int = ROOT_PARENT,
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, from block ``start`` on
    (``parent`` is then the hash of block ``start - 1``). ``extra_keys_per_block[i]``
    enters block ``i``'s hash only (missing entries mean none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    extra = extra_keys_per_block or ()
    n = len(token_ids) // block_size
    if start >= n:
        return []
    # the blocks' token bytes in one pack (block_hash's encoding, a block at a time here)
    tokens = array("I", token_ids[start * block_size : n * block_size])
    if sys.byteorder == "big":
        tokens.byteswap()  # the encoding is little-endian everywhere
    data = tokens.tobytes()
    step = 4 * block_size
    head, digest = _HEAD.pack, xxhash.xxh3_64_intdigest
    out: list[int] = []
    for i, b in enumerate(range(start, n)):
        payload = head(parent, namespace) + data[i * step : (i + 1) * step]
        keys = extra[b] if b < len(extra) else ()
        if keys:
            payload += b"\x1e" + "\x1f".join(keys).encode()
        parent = digest(payload, seed=HASH_SEED)
        out.append(parent)
    return out


def extra_keys_for_spans(
    spans: Sequence[tuple[int, int, str]], num_tokens: int, block_size: int
) -> list[ExtraKeys]:
    """Per full block of a ``num_tokens`` sequence, the keys of the ``(start, end, key)``
    spans (e.g. an image's placeholder tokens ``[start, end)``) that overlap it."""
    n_blocks = num_tokens // block_size
    out: list[list[str]] = [[] for _ in range(n_blocks)]
    for start, end, key in spans:
        if not 0 <= start < end:
            raise ValueError(f"span ({start}, {end}) is empty or negative")
        for b in range(start // block_size, min(-(-end // block_size), n_blocks)):
            out[b].append(key)
    return [tuple(keys) for keys in out]


def image_extra_key(image_hash: str) -> str:
    """The extra key an image adds to the blocks its placeholder tokens cover."""
    return "img:" + image_hash


def image_spans(images: Sequence[ImageRef]) -> list[tuple[int, int, str]]:
    """The ``(start, end, key)`` span of each image's placeholder tokens."""
    return [(im.offset, im.offset + im.num_tokens, image_extra_key(im.hash)) for im in images]


def request_extra_keys(
    images: Sequence[ImageRef], num_tokens: int, block_size: int
) -> list[ExtraKeys]:
    """Per full block of a request's ``num_tokens`` prompt, the keys of the images whose
    placeholders it covers: what the API's router and the engine's block pool both pass
    to :func:`block_hashes` (all empty without images: the blocks hash as plain text)."""
    return extra_keys_for_spans(image_spans(images), num_tokens, block_size)


# ======================================================================================
# Token frames
# ======================================================================================
# One frame per engine step per request, JSON on ``tokens:{request_id}``. ``seq`` counts
# from 0 per request with no gaps; the frame with ``done`` is always the last: it carries
# the finish reason and usage, or an error. A request that asked for logprobs gets one
# Logprob per token id of the frame; one that asked for prompt logprobs gets them on its
# first frame (None for the prompt's first token, which nothing predicts).

# [the token's logprob, its rank among the vocabulary (1: the most likely), the top
# logprobs asked for as [token id, logprob] pairs, most likely first]
Logprob = list
# a logprob below it reads it: OpenAI's stand-in for -inf (JSON has none); every engine's
LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # a predicted output's draft tokens the model accepted and rejected (OpenAI's
    # completion_tokens_details); None where no prediction was used
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


# Error codes of a request the engine refuses as it stands (the caller's to fix): their
# frames say ``invalid_request_error`` and the API answers 400, naming ``param``
REQUEST_ERROR_CODES = frozenset({"invalid_sampling_params", "unsupported_parameter",
                                 "invalid_structured_output", "invalid_lora_adapter"})  # fmt: skip


@dataclass(slots=True)
class FrameError:
    message: str
    code: str
    type: str = "server_error"
    param: str | None = None  # the request field at fault (a refused request's)


@dataclass(slots=True)
class TokenFrame:
    seq: int
    token_ids: list[int]
    text: str = ""
    done: bool = False
    finish_reason: str | None = None  # stop | length | abort (done, no error)
    stop_reason: str | int | None = None  # the stop string or token id that matched
    usage: Usage | None = None
    error: FrameError | None = None
    logprobs: list[Logprob] | None = None  # one per token id
    prompt_logprobs: list[Logprob | None] | None = None  # first frame: one per prompt token
    # an embedding request's one frame (terminal): its vector, base64 of little-endian float32
    embedding: str | None = None

    @classmethod
    def failure(
        cls, seq: int, message: str, code: str, usage: Usage | None = None,
        param: str | None = None,
    ) -> TokenFrame:  # fmt: skip
        """A terminal error frame (a request error's, by its code, or a server error's)."""
        type_ = "invalid_request_error" if code in REQUEST_ERROR_CODES else "server_error"
        return cls(seq, [], "", done=True, usage=usage,
                   error=FrameError(message, code, type_, param))  # fmt: skip

    def encode(self) -> bytes:
        d: dict = {"seq": self.seq, "token_ids": self.token_ids, "text": self.text}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = self.prompt_logprobs
        if self.embedding is not None:
            d["embedding"] = self.embedding
        if self.done:
            d["done"] = True
            if self.error is not None:
                e = self.error
                d["error"] = {"message": e.message, "type": e.type, "code": e.code}
                if e.param is not None:
                    d["error"]["param"] = e.param
            else:
                d["finish_reason"] = self.finish_reason
                d["stop_reason"] = self.stop_reason
            if self.usage is not None:
                u = self.usage
                d["usage"] = {"prompt_tokens": u.prompt_tokens,
                              "completion_tokens": u.completion_tokens,
                              "cached_tokens": u.cached_tokens}  # fmt: skip
                if u.accepted_prediction_tokens is not None:
                    d["usage"]["prediction"] = [u.accepted_prediction_tokens,
                                                u.rejected_prediction_tokens]  # fmt: skip
        return orjson.dumps(d)

    @classmethod
    def decode(cls, raw: bytes | str) -> TokenFrame:
        """Parse a frame; a malformed one raises ``ValueError``."""
        d = orjson.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("seq"), int):
            raise ValueError(f"not a token frame: {raw[:80]!r}")
        frame = cls(d["seq"], d.get("token_ids") or [], d.get("text") or "",
                    bool(d.get("done")), d.get("finish_reason"), d.get("stop_reason"),
                    logprobs=d.get("logprobs"),
                    prompt_logprobs=d.get("prompt_logprobs"),
                    embedding=d.get("embedding"))  # fmt: skip
        u = d.get("usage")
        if u:
            frame.usage = Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                                u.get("cached_tokens", 0))  # fmt: skip
            if pred := u.get("prediction"):
                usage = frame.usage
                usage.accepted_prediction_tokens, usage.rejected_prediction_tokens = pred
        e = d.get("error")
        if e:
            frame.error = FrameError(e.get("message") or "generation failed",
                                     e.get("code") or "engine_error",
                                     e.get("type") or "server_error", e.get("param"))  # fmt: skip
        return frame


# ======================================================================================
# Stage payloads and handles (JSON inside Celery messages: handles and ids, no tensors)
# ======================================================================================


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutput(BaseModel):
    """A constraint on a request's output (structured outputs, vLLM's
    ``StructuredOutputsParams``): exactly one of ``json`` (a JSON Schema, as JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings),
    ``grammar`` (EBNF, as xgrammar reads it) or ``structural_tag`` (xgrammar's structural
    tag, as JSON text: tool calls). The engine compiles it (cached by :meth:`key`) and
    masks every step's logits to what the grammar allows next."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    # JSON without free whitespace between tokens (vLLM's ``disable_any_whitespace``): a
    # bounded schema then always finishes, even on a model with random weights
    any_whitespace: bool = False
    # the request field it came from (e.g. ``response_format.json_schema``), which the
    # engine's error names when the spec does not compile; not part of :meth:`key`
    param: str | None = None
    # a constraint the request did not ask for as such (strict tools under tool_choice
    # auto): an engine without structured outputs serves the request without it rather
    # than refusing it. Not part of :meth:`key`
    best_effort: bool = False
    # a reasoning model's end of thinking (``</think>``'s token ids): the model thinks
    # freely first and the grammar applies from the token after these, as vLLM applies it
    # with a reasoning parser; None: from the first token. Not part of :meth:`key`
    after: list[int] | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutput:
        given = [n for n in STRUCTURED_KINDS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"exactly one of {', '.join(STRUCTURED_KINDS)} must be set, "
                             f"got {', '.join(given) or 'none'}")  # fmt: skip
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        return self

    @property
    def kind(self) -> str:
        return next(n for n in STRUCTURED_KINDS if getattr(self, n) not in (None, False))

    def key(self) -> str:
        """What names the compiled grammar (equal specs compile once)."""
        spec = self.model_dump(exclude={"param", "after", "best_effort"})
        return orjson.dumps(spec, option=orjson.OPT_SORT_KEYS).decode()


MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default cap)


class ThinkingBudget(BaseModel):
    """vLLM's ``thinking_token_budget``, with the reasoning markers it needs as token ids:
    at most ``budget`` tokens inside a thinking block (after ``start``, until
    ``natural_end``), then ``end`` is forced token by token (the engine's
    :mod:`workers.thinking`). A prompt that ends inside a block counts its tokens there."""

    budget: int = Field(ge=0)
    start: list[int] = Field(min_length=1)
    end: list[int] = Field(min_length=1)  # forced (the natural end, or a phrase before it)
    natural_end: list[int] = Field(min_length=1)  # what ends a block the model closes
    # the output starts inside a block whatever the prompt holds (the API's reasoning
    # parser reads it so: its thinking is counted from the first token)
    inside: bool = False


class Sampling(BaseModel):
    """A request's sampling parameters, with vLLM's names and meanings: resolved and
    validated by the API (OpenAI's defaults filled in, words tokenized), carried in the
    stage payload, and taken by the engine as they are (validated again on the way in).

    Penalties: ``presence_penalty`` / ``frequency_penalty`` act on the output tokens so
    far (OpenAI's definition), ``repetition_penalty`` on the prompt's and the output's
    (Hugging Face's). ``logit_bias`` adds to a token's logit; ``allowed_token_ids`` keeps
    only those; ``bad_words`` bans each token sequence's last token after its others.
    ``logprobs``: the sampled token's log-probability and this many of the most likely
    tokens', per output token; ``prompt_logprobs`` the same per prompt token: both the
    model's raw log-softmax (before penalties and temperature), as vLLM returns them.
    ``n``: choices, sharing one prefill. ``structured``: the output's grammar."""

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[list[int]] = Field(default_factory=list)  # token id sequences
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(1, ge=1)
    structured: StructuredOutput | None = None
    skip_special_tokens: bool = True
    # vLLM's cache_salt: the request's blocks are named in a namespace of their own
    # (model_namespace), so its prefix is shared only with requests of the same salt
    cache_salt: str | None = None
    # OpenAI's predicted output (``prediction``), as token ids: the text the output is
    # expected to mostly repeat, drafted from for speculative decoding where the engine
    # speculates (workers.spec_decode); a hint, never a constraint
    prediction: list[int] | None = None
    # vLLM's thinking_token_budget (with the markers' ids): a cap on thinking tokens
    thinking: ThinkingBudget | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Sampling:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")  # fmt: skip
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)  # fmt: skip

    @property
    def processed(self) -> bool:
        """Whether anything besides temperature, top-k/p and min-p shapes the logits."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words or self.structured is not None
                    or self.thinking is not None)  # fmt: skip


class Pooling(BaseModel):
    """A pooling request: the engine runs its prompt through the model once and pools the
    last layer's hidden states (after the final norm). Nothing is sampled; the stream's
    one frame carries the result (``TokenFrame.embedding``, float32).

    ``task`` ``embed`` (``/v1/embeddings``): pooled as the model's pooling config says
    (last token, mean or first token), cut to its first ``dimensions`` values (a
    matryoshka model's), then L2-normalised unless ``normalize`` is False (``None``: as
    the model's pooling config says). ``classify`` (``/classify``, a cross-encoder's
    ``/score``): the last token's hidden state through the checkpoint's classification
    head (``score``, a ``*ForSequenceClassification``), its raw logits, one per label
    (the API applies the model's activation)."""

    task: Literal["embed", "classify"] = "embed"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None


def choice_stream_id(request_id: str, index: int) -> str:
    """The stream of choice ``index`` of a request with ``n > 1`` (each choice streams,
    finishes, is cancelled and migrates on its own id; ``n == 1`` keeps the request's)."""
    return f"{request_id}{CHOICE_SEP}{index}"


CHOICE_SEP = ".c"


def choice_request_id(stream_id: str) -> str | None:
    """The request whose choice streams on ``stream_id`` (:func:`choice_stream_id`);
    ``None`` for a stream that is not a choice's."""
    head, sep, index = stream_id.rpartition(CHOICE_SEP)
    return head if sep and head and index.isdigit() else None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` of a seeded request samples with: choice 0 keeps the
    request's (so ``n=1`` and the first of ``n`` choices draw alike), each other one its
    own, derived from (seed, index) so a seeded request reproduces all its choices and no
    two of them (nor a neighbouring seed's) share a stream."""
    if seed is None or index == 0:
        return seed
    return xxhash.xxh3_64_intdigest(f"{seed}/{index}".encode(), seed=HASH_SEED) >> 1


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index`` of a request's sampling as one request of its own (``n`` 1, its
    seed): what a choice that moves to another worker alone carries (migration)."""
    return sampling.model_copy(update={"n": 1, "seed": choice_seed(sampling.seed, index)})


class ImageRef(BaseModel):
    """One image of a request's prompt. ``hash``: sha256 hex of its decoded pixels (the
    RGB image the model sees, with its size), so the same picture hashes alike however it
    was sent; its bytes are under ``media_key(hash)``. Its placeholder tokens are
    ``prompt_token_ids[offset : offset + num_tokens]``."""

    hash: str
    offset: int = Field(ge=0)
    num_tokens: int = Field(ge=1)


class Resume(BaseModel):
    """A stream continued on another worker after its worker died mid-stream (migration):
    the output tokens the client already has, how many characters of their text it was
    sent, and the ``seq`` of the next frame. The new worker recomputes prompt + these
    tokens, then samples on from output index ``len(output_token_ids)`` (a seeded request
    keeps its per-index seeds); its frames carry on at ``next_seq`` and its usage counts
    the original prompt and every output token once."""

    output_token_ids: list[int] = Field(min_length=1)
    emitted_chars: int = Field(ge=0)
    next_seq: int = Field(ge=1)
    migration: int = Field(ge=1)  # 1 for the first move, 2 for the next...


class StagePayload(BaseModel):
    """Everything a stage task needs to run one request (the same payload for every stage;
    a decode task gets the prefill task's handle in front of it)."""

    request_id: str
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: Sampling
    created: float
    attempt: int = 0  # disagg: how many times the prefill was redone after a failed pull
    forced_first_token: int | None = None  # a redo keeps the first token already streamed
    images: list[ImageRef] = Field(default_factory=list)  # in prompt order
    resume: Resume | None = None  # a migrated stream: what the client already has
    pooling: Pooling | None = None  # an embedding request: pool the prompt, sample nothing
    priority: int = 0  # vLLM's: lower values are served first
    # the LoRA adapter the request names as its model, if any (cluster.lora.LoraRef)
    lora: LoraRef | None = None
    # the W3C traceparent of the API's span for the request, when it is traced
    # (cluster.tracing): each stage task's span on its worker joins that trace
    trace: str | None = None

    @property
    def stream_ids(self) -> list[str]:
        """The streams its frames travel on: its own, or one per choice (``n > 1``)."""
        n = self.sampling.n
        if n == 1:
            return [self.request_id]
        return [choice_stream_id(self.request_id, i) for i in range(n)]


class EmbeddingRef(BaseModel):
    """Where one image's embedding is: the transfer backend's metadata for it."""

    hash: str  # the image's content hash (ImageRef.hash)
    transfer: dict


class EncodeHandle(BaseModel):
    """An encode task's result, handed to the task that prefills: where each image's
    embedding is (``embeddings``, in the order of the payload's images), or that encoding
    failed and the stream already ended with an error frame (``error``)."""

    request_id: str
    encode_worker: str
    embeddings: list[EmbeddingRef] = Field(default_factory=list)
    error: str | None = None


class PrefillHandle(BaseModel):
    """A prefill task's result, handed to its decode task by the chain: where the prompt's
    KV is (``transfer``: the backend's metadata), or that the request already ended on its
    first token (``finished``)."""

    request_id: str
    prefill_worker: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    first_token: int | None = None
    emitted_chars: int = 0  # characters of text the prefill worker already streamed
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, found cached (any KVBM tier) by the prefill worker
    transfer: dict | None = None
    embeddings: list[EmbeddingRef] = Field(default_factory=list)  # the prompt's images

    @property
    def backend(self) -> str:
        return (self.transfer or {}).get("backend", "none")


class StageSummary(BaseModel):
    """What a generate or decode task returns (Flower shows it; nothing else reads it)."""

    request_id: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    redo: int | None = None  # decode: the prefill was sent again, this attempt number
