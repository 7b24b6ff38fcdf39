"""api.routes_embeddings: an embeddings body resolved into each input's token ids and the
pooling parameters, with vLLM's names and defaults, and a 400 naming the field for what is
wrong (the pipeline itself: tests/integration/test_embeddings.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.errors import OpenAIError
from api.routes_embeddings import (
    MAX_INPUTS,
    EmbeddingRequest,
    embedding_inputs,
    model_dimensions,
    pooling_of,
)
from api.tokenization import PromptBuilder
from kvbm.protocol import Pooling


@pytest.fixture(scope="module")
def builder(tiny_model_dir: Path) -> PromptBuilder:
    return PromptBuilder(tiny_model_dir, max_model_len=64)


def req(**kw: object) -> EmbeddingRequest:
    return EmbeddingRequest(model="m", **kw)


def refused(param: str, code: str, fn, *args) -> OpenAIError:  # type: ignore[no-untyped-def]
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    err = e.value
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    return err


def test_every_input_shape(builder: PromptBuilder) -> None:
    tok = builder.tokenizer
    hello = tok.encode("hello", add_special_tokens=True).ids
    assert hello[0] == 1  # the tokenizer adds BOS: inputs get it by default, as in vLLM
    assert embedding_inputs(req(input="hello"), builder) == [hello]
    assert embedding_inputs(req(input=["hello", "a b"]), builder) == [
        hello, tok.encode("a b").ids]  # fmt: skip
    assert embedding_inputs(req(input=[5, 6, 7]), builder) == [[5, 6, 7]]
    assert embedding_inputs(req(input=[[5], [6, 7]]), builder) == [[5], [6, 7]]
    assert embedding_inputs(req(input="hello", add_special_tokens=False), builder) == [
        hello[1:]]  # fmt: skip
    # vLLM's chat form: the template, no generation prompt and no BOS on top by default
    msgs = [{"role": "user", "content": "hello"}]
    ids = embedding_inputs(req(messages=msgs), builder)[0]
    assert (
        ids
        == builder.chat_prompt(
            req(messages=msgs).messages,  # type: ignore[arg-type]
            add_generation_prompt=False,
        ).token_ids
    )
    assert (
        ids
        != builder.chat_prompt(
            req(messages=msgs).messages,  # type: ignore[arg-type]
            add_generation_prompt=True,
        ).token_ids
    )


def test_bad_inputs_are_400s_naming_the_field(builder: PromptBuilder) -> None:
    refused("input", "invalid_value", embedding_inputs, req(), builder)
    both = req(input="x", messages=[{"role": "user", "content": "x"}])
    refused("input", "invalid_value", embedding_inputs, both, builder)
    refused("input", "invalid_value", embedding_inputs, req(input=[]), builder)
    refused("input", "invalid_value", embedding_inputs, req(input=[[1], []]), builder)
    refused("input", "invalid_value", embedding_inputs, req(input=[1, 512]), builder)
    refused("input", "invalid_value", embedding_inputs, req(input=[[1], [-1]]), builder)
    refused("input", "invalid_value", embedding_inputs, req(input=["x"] * (MAX_INPUTS + 1)),
            builder)  # fmt: skip
    empty = req(input="", add_special_tokens=False)
    refused("input", "invalid_value", embedding_inputs, empty, builder)
    long = req(input=[[3] * 10, [3] * 65])  # the window is 64 tokens: 64 fit, 65 do not
    err = refused("input", "context_length_exceeded", embedding_inputs, long, builder)
    assert "input 1 has 65 tokens" in err.message
    assert embedding_inputs(req(input=[3] * 64), builder) == [[3] * 64]
    image = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "https://x/y.png"}}]}]  # fmt: skip
    refused("messages", "unsupported_content", embedding_inputs, req(messages=image), builder)
    with pytest.raises(ValidationError):  # a shape the schema refuses (the API: a 400)
        req(input=[1, "x"])
    with pytest.raises(ValidationError):
        req(encoding_format="bytes")


def test_truncate_prompt_tokens(builder: PromptBuilder) -> None:
    ids = list(range(3, 103))  # 100 tokens: longer than the 64-token window
    assert builder.truncation_side == "right"
    assert embedding_inputs(req(input=ids, truncate_prompt_tokens=10), builder) == [ids[:10]]
    left = req(input=ids, truncate_prompt_tokens=10, truncation_side="left")
    assert embedding_inputs(left, builder) == [ids[-10:]]
    assert embedding_inputs(req(input=ids, truncate_prompt_tokens=-1), builder) == [ids[:64]]
    assert embedding_inputs(req(input=[5, 6], truncate_prompt_tokens=10), builder) == [[5, 6]]
    for bad in (0, 65):
        refused("truncate_prompt_tokens", "invalid_value", embedding_inputs,
                req(input=ids, truncate_prompt_tokens=bad), builder)  # fmt: skip


def test_pooling_parameters(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = str(tiny_model_dir)
    assert pooling_of(req(input="x"), d, "m") == Pooling()
    assert pooling_of(req(input="x", use_activation=False), d, "m") == Pooling(normalize=False)
    err = refused("dimensions", "invalid_value", pooling_of, req(input="x", dimensions=8), d,
                  "tiny")  # fmt: skip
    assert 'Model "tiny" does not support matryoshka representation' in err.message
    refused("normalize", "invalid_value", pooling_of, req(input="x", normalize=True), d, "m")
    # a matryoshka checkpoint: any size up to the hidden size, or only the listed ones
    for name, extra in (("any", {"is_matryoshka": True}), ("some", {"matryoshka_dimensions":
                                                                     [32, 64]})):  # fmt: skip
        m = tmp_path / name
        shutil.copytree(tiny_model_dir, m)
        cfg = json.loads((m / "config.json").read_text())
        (m / "config.json").write_text(json.dumps({**cfg, **extra}))
        assert model_dimensions(str(m))[0]
        assert pooling_of(req(input="x", dimensions=32), str(m), "m") == Pooling(dimensions=32)
        for bad in (0, 129) if name == "any" else (0, 48, 129):
            refused("dimensions", "invalid_value", pooling_of,
                    req(input="x", dimensions=bad), str(m), "m")  # fmt: skip
