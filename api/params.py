"""A request's sampling fields, resolved once into the engine's :class:`Sampling`.

OpenAI's defaults are filled in, vLLM's extensions mapped by their own names, and whatever
needs the model (token ids in range, words to token ids) checked against its tokenizer;
anything wrong is a 400 naming the field, with vLLM's meaning. What the chosen engine
cannot serve is not decided here: the engine refuses it on its first frame, which the API
turns into a 400 naming the field (``unsupported_parameter``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from api.errors import bad_request
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.schemas import checked_schema
from api.tokenization import PromptBuilder
from kvbm.protocol import MAX_LOGPROBS, Sampling, StructuredOutput, ThinkingBudget

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias; vLLM clamps to it as well
STRUCTURED_BACKENDS = (None, "auto", "xgrammar")

Request = ChatCompletionRequest | CompletionRequest


# What a model's generation_config.json may set a request's defaults of (vLLM's list), and
# Hugging Face's own defaults for them: a value equal to its default is no default of the
# model's (as Hugging Face's to_diff_dict, which vLLM reads, leaves it out)
GENERATION_DEFAULTS: dict[str, float | int | None] = {
    "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
    "max_new_tokens": None,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A deployment's sampling defaults (vLLM's ``--generation-config``): what a request
    that does not set a field gets instead of OpenAI's default, and the cap on every
    request's ``max_tokens`` (None: only the context window's)."""

    values: dict[str, float | int] = field(default_factory=dict)
    max_tokens_cap: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path, source: str = "auto",
             override: dict | None = None) -> SamplingDefaults:  # fmt: skip
        """``source``: "auto" (the model's generation_config.json), "vllm" (none) or a
        directory holding one; ``override`` over it (vLLM's
        ``--override-generation-config``). As vLLM: the model's max_new_tokens is the default
        max_tokens; a directory's, or the override's, caps every request."""
        config: dict = {}
        if source != "vllm":
            path = Path(model_dir if source == "auto" else source) / "generation_config.json"
            if source != "auto" and not path.is_file():
                raise ValueError(f"generation_config: no {path}")
            raw = json.loads(path.read_text()) if path.is_file() else {}
            config = {k: v for k, v in raw.items()
                      if k in GENERATION_DEFAULTS and v is not None
                      and v != GENERATION_DEFAULTS[k]}  # fmt: skip
        config.update({k: v for k, v in (override or {}).items()
                       if k in GENERATION_DEFAULTS and v is not None})  # fmt: skip
        values: dict[str, float | int] = {k: v for k, v in config.items() if k != "max_new_tokens"}
        if "max_new_tokens" in config:
            values["max_tokens"] = int(config["max_new_tokens"])
        cap = (override or {}).get("max_new_tokens") if source in ("auto", "vllm") \
            else values.get("max_tokens")  # fmt: skip
        return cls(values, int(cap) if cap is not None else None)

    def max_tokens(self, asked: int | None, room: int) -> int:
        """A request's max_tokens: what it asked (else the default, else the room left in
        the context), within the cap (vLLM's get_max_tokens)."""
        chosen = asked if asked is not None else self.values.get("max_tokens")
        return int(min(v for v in (room, chosen, self.max_tokens_cap) if v is not None))


def sampling_of(req: Request, max_tokens: int, builder: PromptBuilder,
                defaults: SamplingDefaults | None = None) -> Sampling:  # fmt: skip
    """The request's sampling parameters: what it sets, else the deployment's defaults
    (``defaults``: the model's generation config), else OpenAI's."""
    d = defaults.values if defaults is not None else {}
    logprobs, prompt_logprobs = _logprobs(req)
    top_k = req.top_k if req.top_k is not None else d.get("top_k", 0)
    return Sampling(
        max_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
        top_k=0 if top_k == -1 else int(top_k),
        min_p=req.min_p if req.min_p is not None else d.get("min_p", 0.0),
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=_token_ids(req.stop_token_ids or [], builder, "stop_token_ids"),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty
        if req.repetition_penalty is not None
        else d.get("repetition_penalty", 1.0),  # fmt: skip
        logit_bias=_logit_bias(req.logit_bias, builder),
        allowed_token_ids=_allowed(req.allowed_token_ids, builder),
        bad_words=_bad_words(req.bad_words or [], builder),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=req.n,
        structured=structured_of(req),
        skip_special_tokens=req.skip_special_tokens,
        cache_salt=req.cache_salt,
        prediction=_prediction(getattr(req, "prediction", None), builder),
        thinking=_thinking(req.thinking_token_budget, builder),
    )


def structured_of(req: Request) -> StructuredOutput | None:
    """The constraint the request puts on its output: ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``structured_outputs`` or its older ``guided_*`` fields, at most
    one of them; ``None`` for free text."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    guided = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
              "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar}  # fmt: skip
    for name, value in guided.items():
        if value is not None:
            found.append((name, _guided(name, value)))
    if req.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported by the xgrammar backend; "
                          "JSON is generated without free whitespace",
                          "guided_whitespace_pattern", "unsupported_parameter")  # fmt: skip
    if req.guided_decoding_backend not in STRUCTURED_BACKENDS:
        raise bad_request(f"guided_decoding_backend {req.guided_decoding_backend!r} is not "
                          "available; Conveyor uses xgrammar", "guided_decoding_backend",
                          "unsupported_parameter")  # fmt: skip
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"only one kind of structured output may be given, got {names}",
                          found[1][0])  # fmt: skip
    return found[0][1] if found else None


# --------------------------------------------------------------------------------------
def _logprobs(req: Request) -> tuple[int | None, int | None]:
    """(top logprobs per output token or None, per prompt token or None)."""
    prompt = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true",
                              "top_logprobs")  # fmt: skip
        out = (req.top_logprobs or 0) if req.logprobs else None
    else:
        out = req.logprobs
        if req.echo and req.logprobs is not None:  # the echoed prompt comes with its own
            prompt = max(prompt or 0, req.logprobs)
    if prompt is not None and not 0 <= prompt <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (-1, the whole "
                          "vocabulary, is not supported)", "prompt_logprobs")  # fmt: skip
    return out, prompt


def _thinking(budget: int | None, builder: PromptBuilder) -> ThinkingBudget | None:
    """vLLM's ``thinking_token_budget`` with this deployment's reasoning markers."""
    if budget is None:
        return None
    if builder.thinking_markers is None:
        raise bad_request("thinking_token_budget needs the reasoning markers: set "
                          "CONVEYOR_REASONING_PARSER or CONVEYOR_REASONING_CONFIG",
                          "thinking_token_budget")  # fmt: skip
    start, end, natural = builder.thinking_markers
    return ThinkingBudget(budget=budget, start=start, end=end, natural_end=natural)


def _token_ids(ids: list[int], builder: PromptBuilder, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < builder.vocab_size]
    if bad:
        raise bad_request(f"{param} contains out-of-vocabulary token id {bad[0]} (the "
                          f"vocabulary is [0, {builder.vocab_size}))", param)  # fmt: skip
    return list(ids)


def _logit_bias(bias: dict[str, float] | None, builder: PromptBuilder) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None  # fmt: skip
        _token_ids([tok], builder, "logit_bias")
        out[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out


def _allowed(ids: list[int] | None, builder: PromptBuilder) -> list[int] | None:
    if ids is None:
        return None
    if not ids:
        raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
    return sorted(set(_token_ids(ids, builder, "allowed_token_ids")))


# the longest predicted output taken, in tokens (OpenAI sets none; this bounds the index)
MAX_PREDICTION_TOKENS = 32768


def _prediction(prediction: dict | None, builder: PromptBuilder) -> list[int] | None:
    """OpenAI's ``prediction`` (``{"type": "content", "content": <text or text parts>}``)
    as the token ids the output is expected to repeat."""
    if prediction is None:
        return None
    if prediction.get("type") != "content":
        raise bad_request("prediction.type must be 'content'", "prediction.type")
    content = prediction.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):  # fmt: skip
            raise bad_request("prediction.content parts must be text parts",
                              "prediction.content")  # fmt: skip
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request("prediction.content must be a string or text parts",
                          "prediction.content")  # fmt: skip
    ids = builder.tokenizer.encode(content, add_special_tokens=False).ids
    if len(ids) > MAX_PREDICTION_TOKENS:
        raise bad_request(f"prediction.content is longer than {MAX_PREDICTION_TOKENS} tokens",
                          "prediction.content")  # fmt: skip
    return ids or None


def _bad_words(words: list[str], builder: PromptBuilder) -> list[list[int]]:
    """Each word as token ids, as it reads at the start of the text and after a space
    (vLLM's rule: the spaced form counts when it is a different first token of the same
    length)."""
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words must not contain empty words", "bad_words")
        bare = builder.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        spaced = builder.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def _response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a `schema`",
                              "response_format.json_schema")  # fmt: skip
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema.schema must be a JSON Schema "
                              "object", "response_format.json_schema.schema")  # fmt: skip
        param = "response_format.json_schema"
        return StructuredOutput(json_schema=checked_schema(schema, param), param=param)
    if kind == "structural_tag":
        return StructuredOutput(structural_tag=json.dumps(rf), param="response_format")
    raise bad_request(f"response_format type {kind!r} is not one of text, json_object, "
                      "json_schema, structural_tag", "response_format.type")  # fmt: skip


def _structured_outputs(so: dict) -> StructuredOutput:
    """vLLM's ``structured_outputs`` object."""
    fields = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object", "structural_tag": "structural_tag"}  # fmt: skip
    given = {k: v for k, v in so.items() if k in fields and v not in (None, False)}
    if len(given) != 1:
        raise bad_request("structured_outputs must set exactly one of "
                          f"{', '.join(fields)}", "structured_outputs")  # fmt: skip
    ((key, value),) = given.items()
    param = f"structured_outputs.{key}"
    if key == "json":
        value = checked_schema(value, param)
    elif key == "structural_tag" and not isinstance(value, str):
        value = json.dumps(value)
    try:
        return StructuredOutput(
            **{fields[key]: value}, param=param,
            any_whitespace=not so.get("disable_any_whitespace", True),
        )  # fmt: skip
    except ValueError as e:
        raise bad_request(f"structured_outputs.{key}: {e}",
                          f"structured_outputs.{key}") from None  # fmt: skip


def _guided(name: str, value: object) -> StructuredOutput:
    try:
        if name == "guided_json":
            return StructuredOutput(json_schema=checked_schema(value, name), param=name)
        if name == "guided_choice":
            return StructuredOutput(choice=value, param=name)
        return StructuredOutput(**{name.removeprefix("guided_"): value},
                                param=name)  # fmt: skip
    except ValueError as e:
        raise bad_request(f"{name}: {e}", name) from None
