"""api.params: a request's sampling fields resolved into the engine's Sampling, with
OpenAI's defaults, vLLM's names and a 400 naming the field for what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.errors import OpenAIError
from api.params import SamplingDefaults, sampling_of, structured_of
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.tokenization import PromptBuilder
from kvbm.protocol import Sampling, StructuredOutput


@pytest.fixture(scope="module")
def builder(tiny_model_dir: Path) -> PromptBuilder:
    return PromptBuilder(tiny_model_dir)


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


def refused(param: str, req: ChatCompletionRequest | CompletionRequest,
            builder: PromptBuilder) -> OpenAIError:  # fmt: skip
    with pytest.raises(OpenAIError) as e:
        sampling_of(req, 16, builder)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value


def test_defaults_are_openais(builder: PromptBuilder) -> None:
    s = sampling_of(chat(), 16, builder)
    assert s == Sampling(max_tokens=16)
    assert s.temperature == 1.0 and s.top_p == 1.0 and s.logprobs is None and s.n == 1
    assert not s.processed and s.structured is None


def test_every_field_reaches_the_sampling(builder: PromptBuilder) -> None:
    req = chat(temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, stop=["a"],
               stop_token_ids=[2], include_stop_str_in_output=True, ignore_eos=True,
               min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5,
               repetition_penalty=1.2, logit_bias={"5": 150, "7": -3}, allowed_token_ids=[9, 4, 9],
               logprobs=True, top_logprobs=3, prompt_logprobs=2, n=4,
               skip_special_tokens=False, cache_salt="t1")  # fmt: skip
    s = sampling_of(req, 16, builder)
    assert s.cache_salt == "t1" and sampling_of(chat(), 16, builder).cache_salt is None
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 7, 0.1, 3)
    assert s.stop == ["a"] and s.stop_token_ids == [2] and s.include_stop_str_in_output
    assert s.ignore_eos and s.min_tokens == 2 and not s.skip_special_tokens
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert s.logit_bias == {5: 100.0, 7: -3.0}  # clamped to OpenAI's range
    assert s.allowed_token_ids == [4, 9]
    assert (s.logprobs, s.prompt_logprobs, s.n) == (3, 2, 4)
    assert s.penalized and s.processed


def test_logprobs_chat_and_completions(builder: PromptBuilder) -> None:
    assert sampling_of(chat(logprobs=True), 16, builder).logprobs == 0
    assert sampling_of(chat(logprobs=False, top_logprobs=0), 16, builder).logprobs is None
    refused("top_logprobs", chat(top_logprobs=2), builder)
    done = sampling_of(CompletionRequest(model="m", prompt="x", logprobs=2), 16, builder)
    assert (done.logprobs, done.prompt_logprobs) == (2, None)
    # echo with logprobs: the echoed prompt comes with its logprobs too
    echo = sampling_of(CompletionRequest(model="m", prompt="x", logprobs=3, echo=True), 16,
                       builder)  # fmt: skip
    assert (echo.logprobs, echo.prompt_logprobs) == (3, 3)


def test_token_ids_are_checked_against_the_vocabulary(builder: PromptBuilder) -> None:
    v = builder.vocab_size
    refused("logit_bias", chat(logit_bias={str(v): 1.0}), builder)
    refused("logit_bias", chat(logit_bias={"abc": 1.0}), builder)
    refused("allowed_token_ids", chat(allowed_token_ids=[v]), builder)
    refused("allowed_token_ids", chat(allowed_token_ids=[]), builder)
    refused("stop_token_ids", chat(stop_token_ids=[-1]), builder)
    refused("prompt_logprobs", chat(prompt_logprobs=-1), builder)


def test_bad_words_are_token_sequences_with_and_without_a_leading_space(
    builder: PromptBuilder,
) -> None:
    s = sampling_of(chat(bad_words=["hello"]), 16, builder)
    bare = builder.tokenizer.encode("hello", add_special_tokens=False).ids
    spaced = builder.tokenizer.encode(" hello", add_special_tokens=False).ids
    assert s.bad_words[0] == bare
    assert (spaced in s.bad_words) == (spaced[0] != bare[0] and len(spaced) == len(bare))
    refused("bad_words", chat(bad_words=[" "]), builder)


def test_structured_outputs_from_every_spelling() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    # each names the field it came from (what an engine's compile error names)
    assert structured_of(chat(response_format=rf)) == StructuredOutput(
        json_schema=json.dumps(schema), param="response_format.json_schema"
    )
    so = structured_of(chat(response_format={"type": "json_object"}))
    assert so.kind == "json_object" and so.param == "response_format"
    assert structured_of(chat(response_format={"type": "text"})) is None
    so = structured_of(chat(guided_json=schema))
    assert so.json_schema == json.dumps(schema) and so.param == "guided_json"
    assert structured_of(chat(guided_json=json.dumps(schema))).json_schema == json.dumps(schema)
    assert structured_of(chat(guided_regex="[a-z]+")).regex == "[a-z]+"
    so = structured_of(chat(guided_choice=["yes", "no"]))
    assert so.choice == ["yes", "no"] and so.param == "guided_choice"
    assert structured_of(chat(guided_grammar='root ::= "a"')).grammar == 'root ::= "a"'
    so = structured_of(chat(structured_outputs={"json": schema, "disable_any_whitespace": False}))
    assert so.json_schema == json.dumps(schema) and so.any_whitespace
    assert so.param == "structured_outputs.json"
    assert structured_of(chat(structured_outputs={"choice": ["a"]})).choice == ["a"]
    # the field it came from is not part of what names the compiled grammar
    assert so.key() == StructuredOutput(json_schema=json.dumps(schema), any_whitespace=True).key()


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
         "response_format.json_schema", "'foo' is not valid"),
        ({"guided_json": {"type": "object", "properties": {"a": {"maxLength": -1}}}},
         "guided_json", "properties/a/maxLength"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "must be a JSON Schema"),
        ({"structured_outputs": {"json": {"type": "array", "minItems": "2"}}},
         "structured_outputs.json", "'2' is not of type 'integer' (at minItems)"),
    ],
)  # fmt: skip
def test_an_invalid_json_schema_is_a_400_saying_what_is_wrong(kw: dict, param: str,
                                                              says: str) -> None:  # fmt: skip
    with pytest.raises(OpenAIError) as e:
        structured_of(chat(**kw))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.code == "invalid_structured_output"
    assert says in e.value.message, e.value.message


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_whitespace_pattern": r"\s"}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_structured_outputs_refused_with_the_field(kw: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        structured_of(chat(**kw))
    assert e.value.status == 400 and e.value.param == param


def _gen_config(d: Path, **values: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return d


def test_generation_config_defaults_as_vllm_reads_them(tmp_path: Path) -> None:
    model = _gen_config(tmp_path / "m", temperature=0.6, top_p=0.95, top_k=50, do_sample=True,
                        repetition_penalty=1.0, max_new_tokens=64, min_p=None)  # fmt: skip
    auto = SamplingDefaults.load(model)
    # top_k 50 and repetition_penalty 1.0 are Hugging Face's own defaults: no model default
    assert auto.values == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 64}
    assert auto.max_tokens_cap is None
    assert auto.max_tokens(None, 1000) == 64 and auto.max_tokens(200, 1000) == 200
    assert auto.max_tokens(None, 10) == 10  # the context's room first
    assert SamplingDefaults.load(model, "vllm").values == {}
    over = SamplingDefaults.load(model, "auto", {"temperature": 0.2, "max_new_tokens": 32})
    assert over.values == {"temperature": 0.2, "top_p": 0.95, "max_tokens": 32}
    assert over.max_tokens_cap == 32 and over.max_tokens(200, 1000) == 32  # caps every one
    other = SamplingDefaults.load(model, str(_gen_config(tmp_path / "g", max_new_tokens=8)))
    assert other.values == {"max_tokens": 8} and other.max_tokens(100, 1000) == 8
    with pytest.raises(ValueError, match="generation_config"):
        SamplingDefaults.load(model, str(tmp_path / "nowhere"))
    assert SamplingDefaults.load(tmp_path / "bare").values == {}  # no file: none


def test_a_requests_own_fields_win_over_the_models_defaults(builder: PromptBuilder) -> None:
    d = SamplingDefaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                          "repetition_penalty": 1.1})  # fmt: skip
    s = sampling_of(chat(), 8, builder, d)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)  # fmt: skip
    s = sampling_of(chat(temperature=0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0),
                    8, builder, d)  # fmt: skip
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        0.0, 1.0, 0, 0.0, 1.0)  # fmt: skip
