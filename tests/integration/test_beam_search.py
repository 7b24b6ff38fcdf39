"""Beam search (vLLM's ``use_beam_search``) on the cluster, through the official client:
the beams are those the same search finds with Hugging Face's model on the same
checkpoint (the test's own implementation of vLLM's algorithm, over HF's log-softmax),
for completions and chat, with and without a length penalty; what beam search does not
take is a clear 400."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from tests.integration.conftest import Cluster
from workers.model_init import EOS

pytestmark = pytest.mark.integration

PROMPT = [1, 407, 83, 16, 368, 331, 5, 225, 302, 370, 324, 225]


@pytest.fixture(scope="module")
def hf(cluster: Cluster) -> tuple:
    tok = AutoTokenizer.from_pretrained(cluster.model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(cluster.model_dir).eval()
    return tok, model


def hf_beams(model, prompt: list[int], width: int, steps: int,  # type: ignore[no-untyped-def]
             length_penalty: float = 1.0) -> list[tuple[list[int], float]]:  # fmt: skip
    """vLLM's beam search over HF's log-probabilities: (tokens, score) of the best beams."""

    def score(b: tuple[list[int], float]) -> float:
        n = len(prompt) + len(b[0]) - (1 if b[0] and b[0][-1] == EOS else 0)
        return b[1] / n**length_penalty

    live: list[tuple[list[int], float]] = [([], 0.0)]
    done = []
    for _ in range(steps):
        grown = []
        for toks, cum in live:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + toks])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for t, x in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                (done if t == EOS else grown).append((toks + [t], cum + x))
        live = sorted(grown, key=score, reverse=True)[:width]
    best = sorted(done + live, key=score, reverse=True)[:width]
    return [(b[0], score(b)) for b in best]


@pytest.mark.parametrize(("width", "penalty"), [(3, 1.0), (2, 0.5)])
def test_completion_beams_are_hugging_faces(cluster: Cluster, hf: tuple, width: int,
                                            penalty: float) -> None:  # fmt: skip
    tok, model = hf
    want = hf_beams(model, PROMPT, width, 6, penalty)
    r = cluster.client().completions.create(
        model=cluster.model_name, prompt=PROMPT, max_tokens=6, n=width,
        extra_body={"use_beam_search": True, "length_penalty": penalty},
    )  # fmt: skip
    assert [c.index for c in r.choices] == list(range(width))
    for c, (toks, _) in zip(r.choices, want, strict=True):
        ended = toks[-1] == EOS
        assert c.text == tok.decode(toks[:-1] if ended else toks, skip_special_tokens=True)
        assert c.finish_reason == ("stop" if ended else "length")
    assert r.usage.prompt_tokens == len(PROMPT)  # type: ignore[union-attr]
    shown = sum(len(t) - (t[-1] == EOS) for t, _ in want)  # a final EOS is not counted
    assert r.usage.completion_tokens == shown  # type: ignore[union-attr]
    # the beams differ from one another: a search, not n copies of one answer
    assert len({c.text for c in r.choices}) == width


def test_chat_beams_are_hugging_faces(cluster: Cluster, hf: tuple) -> None:
    tok, model = hf
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_beams(model, ids, 2, 5)
    r = cluster.client().chat.completions.create(
        model=cluster.model_name, messages=messages, max_tokens=5, n=2,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    got = [c.message.content for c in r.choices]
    assert got == [tok.decode(t[:-1] if t[-1] == EOS else t, skip_special_tokens=True)
                   for t, _ in want]  # fmt: skip
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)  # type: ignore[union-attr]


def test_streamed_beams_are_the_whole_answers_beams(cluster: Cluster) -> None:
    """Streamed (as vLLM streams a search: the beams once it has ended), the choices'
    texts and finishes are the non-streamed answer's, and the stream ends with usage."""
    client = cluster.client()
    kw = {"model": cluster.model_name, "max_tokens": 5, "n": 3,
          "extra_body": {"use_beam_search": True}}  # fmt: skip
    whole = client.completions.create(prompt=PROMPT, **kw)  # type: ignore[call-overload]
    texts, finish, usage = {}, {}, None
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in client.completions.create(prompt=PROMPT, **opts, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]
    parts: dict[int, str] = {}
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert [parts[i] for i in range(3)] == [c.message.content for c in chat.choices]


def test_what_beam_search_does_not_take_is_a_400(cluster: Cluster) -> None:
    client = cluster.client()
    for extra, param in [
        ({"n": 11}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": [PROMPT, PROMPT]}, "prompt"),
        ({"echo": True}, "echo"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:  # extra_body's fields win
            body = {"use_beam_search": True, **extra}
            client.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=4,
                                      n=2, extra_body=body)  # fmt: skip
        assert e.value.body["param"] == param, (extra, e.value.body)  # type: ignore[index]
