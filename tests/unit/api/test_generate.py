"""api.routes_generate's translation between vLLM's SamplingParams and the engine's
Sampling: a rendered request's sampling, read back by generate, is the same Sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.errors import OpenAIError
from api.params import sampling_of
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.routes_generate import GenerateRequest, completion_request, vllm_sampling_params
from api.tokenization import PromptBuilder

PROMPT = [1, 72, 301, 44]


@pytest.fixture(scope="module")
def builder(tiny_model_dir: Path) -> PromptBuilder:
    return PromptBuilder(tiny_model_dir)


def _generate(sp: dict) -> CompletionRequest:
    return completion_request(GenerateRequest(token_ids=PROMPT, sampling_params=sp), "m")


@pytest.mark.parametrize("fields", [
    {},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "n": 2},
    {"stop": ["\n", "end"], "stop_token_ids": [5], "include_stop_str_in_output": True,
     "ignore_eos": True, "min_tokens": 2},
    {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
     "logit_bias": {"7": 3.0}, "allowed_token_ids": [1, 2, 3], "bad_words": ["no"]},
    {"logprobs": 3, "prompt_logprobs": 1, "skip_special_tokens": False},
    {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": False}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"response_format": {"type": "json_object"}},
])  # fmt: skip
def test_a_rendered_sampling_reads_back_the_same(builder: PromptBuilder, fields: dict) -> None:
    chat_fields = dict(fields)
    if "logprobs" in chat_fields:  # chat's names for them
        chat_fields.update(logprobs=True, top_logprobs=chat_fields["logprobs"])
    for req in (CompletionRequest(model="m", prompt=PROMPT, **fields),
                ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                      **chat_fields)):  # fmt: skip
        s = sampling_of(req, 12, builder)
        back = _generate(vllm_sampling_params(s, req))
        again = sampling_of(back, back.max_tokens or 0, builder)
        assert again.model_dump(exclude={"structured"}) == s.model_dump(exclude={"structured"})
        if s.structured is None:
            assert again.structured is None
        else:  # the same constraint (its key), whichever field it came from
            assert again.structured is not None and again.structured.key() == s.structured.key()


def test_no_max_tokens_is_the_rest_of_the_context(builder: PromptBuilder) -> None:
    assert _generate({}).max_tokens is None  # not completions' default of 16
    assert _generate({"max_tokens": 5}).max_tokens == 5
    room = builder.check_length(len(PROMPT), None, "token_ids")
    assert room == builder.max_model_len - len(PROMPT)


def test_vllm_shapes_are_read_as_vllm_writes_them(builder: PromptBuilder) -> None:
    req = _generate({"stop": "x", "logit_bias": {3: 1.5}, "detokenize": True,
                     "structured_outputs": {"json": '{"type": "object"}'}})  # fmt: skip
    s = sampling_of(req, 4, builder)
    assert s.stop == ["x"] and s.logit_bias == {3: 1.5}
    assert s.structured is not None and s.structured.json_schema is not None


@pytest.mark.parametrize(("sp", "param"), [
    ({"temprature": 1.0}, "sampling_params.temprature"),
    ({"prompt_logprob_token_ids": [1]}, "sampling_params.prompt_logprob_token_ids"),
    ({"temperature": "hot"}, "sampling_params.temperature"),
    ({"structured_outputs": {"json": "{not json"}}, "sampling_params.structured_outputs.json"),
])  # fmt: skip
def test_what_generate_cannot_read_is_a_400_naming_it(sp: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        _generate(sp)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_bad_top_level_field_is_named_as_the_body_names_it() -> None:
    with pytest.raises(OpenAIError) as e:
        completion_request(GenerateRequest(token_ids=PROMPT, priority=2**40), "m")
    assert e.value.param == "priority"
