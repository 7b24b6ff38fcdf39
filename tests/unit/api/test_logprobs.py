"""OpenAI's logprobs shapes from the frames' logprobs (api.logprobs), on the tiny model's
tokenizer: chat and completions entries, text offsets across chunks, the sampled token
added to completions' top, vLLM's prompt_logprobs, echo; streamed chunks reassemble to
the whole response; the chunk template equals the chunk built in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from api.logprobs import ExtraOutput, LogprobsRenderer, TokenStrings, prompt_logprobs
from api.sse import Formatter, sse_event
from kvbm.protocol import TokenFrame


@pytest.fixture(scope="module")
def strings(tiny_model_dir: Path) -> TokenStrings:
    return TokenStrings(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))


def _ids(strings: TokenStrings, text: str) -> list[int]:
    return strings._tok.encode(text, add_special_tokens=False).ids


def _lp(token: int, value: float, top: list[tuple[int, float]], rank: int = 1) -> list:
    return [value, rank, [list(p) for p in top]]


def test_chat_entries(strings: TokenStrings) -> None:
    a, b = _ids(strings, "Hello")[0], _ids(strings, " world")[0]
    r = LogprobsRenderer(strings, chat=True, top=2)
    lps = [_lp(a, -0.5, [(a, -0.5), (b, -1.25)]), _lp(b, -2.0, [(a, -0.1), (7, -1.5)], rank=3)]
    body = json.loads(r.render([a, b], lps))
    sa, sb = strings.text(a), strings.text(b)
    assert body == {
        "content": [
            {
                "token": sa,
                "logprob": -0.5,
                "bytes": list(sa.encode()),
                "top_logprobs": [
                    {"token": sa, "logprob": -0.5, "bytes": list(sa.encode())},
                    {"token": sb, "logprob": -1.25, "bytes": list(sb.encode())},
                ],
            },
            {
                "token": sb,
                "logprob": -2.0,
                "bytes": list(sb.encode()),
                "top_logprobs": [
                    {"token": sa, "logprob": -0.1, "bytes": list(sa.encode())},
                    {
                        "token": strings.text(7),
                        "logprob": -1.5,
                        "bytes": list(strings.text(7).encode()),
                    },
                ],
            },
        ]
    }
    # top_logprobs=0: the token alone
    assert json.loads(LogprobsRenderer(strings, True, 0).render([a], lps[:1])) == {
        "content": [{"token": sa, "logprob": -0.5, "bytes": list(sa.encode()), "top_logprobs": []}]
    }


def test_token_strings_are_single_token_decodes_with_specials(strings: TokenStrings) -> None:
    ids = _ids(strings, "é中🙂")
    partial = [i for i in ids if "\ufffd" in strings.text(i)]
    assert partial, "some token ends inside a character"
    entry = json.loads(LogprobsRenderer(strings, True, 0).render(partial[:1], [[-1.0, 1, []]]))
    tok = entry["content"][0]
    assert tok["token"] == strings._tok.decode(partial[:1], skip_special_tokens=False)
    assert tok["bytes"] == list(tok["token"].encode("utf-8"))
    assert strings.text(2) == "</s>"  # special tokens are kept, as vLLM decodes one token


def test_completion_entries_offsets_and_the_sampled_token(strings: TokenStrings) -> None:
    a, b, c = _ids(strings, "Hello world!")[:3]
    r = LogprobsRenderer(strings, chat=False, top=1)
    sa, sb, sc = strings.text(a), strings.text(b), strings.text(c)
    # chunk 1: a was the likeliest; chunk 2: b was sampled though c was likelier
    one = json.loads(r.render([a], [_lp(a, -0.2, [(a, -0.2)])], text=sa))
    assert one == {
        "text_offset": [0],
        "token_logprobs": [-0.2],
        "tokens": [sa],
        "top_logprobs": [{sa: -0.2}],
    }
    two = json.loads(
        r.render(
            [b, c], [_lp(b, -3.0, [(c, -0.4)], rank=2), _lp(c, -0.1, [(c, -0.1)])], text=sb + sc
        )
    )
    assert two == {
        "text_offset": [len(sa), len(sa) + len(sb)],
        "token_logprobs": [-3.0, -0.1],
        "tokens": [sb, sc],
        "top_logprobs": [{sc: -0.4, sb: -3.0}, {sc: -0.1}],
    }
    assert list(two["top_logprobs"][0]) == [sc, sb]  # most likely first, the sampled one after
    # an echoed prompt's first token has no logprob
    none = json.loads(LogprobsRenderer(strings, False, 2).render([1], [None]))
    assert none == {
        "text_offset": [0],
        "token_logprobs": [None],
        "tokens": ["<s>"],
        "top_logprobs": [None],
    }


def test_prompt_logprobs_are_vllms(strings: TokenStrings) -> None:
    ids = [1, *_ids(strings, "Hi there")[:2]]
    lps = [
        None,
        _lp(ids[1], -4.0, [(9, -1.0), (ids[1], -4.0)], rank=2),
        _lp(ids[2], -0.3, [(ids[2], -0.3), (9, -2.0)]),
    ]
    out = prompt_logprobs(strings, ids, lps)
    assert out[0] is None
    assert out[1] == {
        str(ids[1]): {"logprob": -4.0, "rank": 2, "decoded_token": strings.text(ids[1])},
        "9": {"logprob": -1.0, "rank": 1, "decoded_token": strings.text(9)},
    }
    assert list(out[1]) == [str(ids[1]), "9"]  # the prompt's token first, as vLLM lists it
    assert list(out[2]) == [str(ids[2]), "9"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_logprobs_event_equals_the_full_chunk(kind: str, include_usage: bool) -> None:
    fmt = Formatter(kind, "cmpl-0123456789abcdef", 'model "x"')
    lps = '{"content":[]}' if kind == "chat" else '{"tokens":["\\u00e9"]}'
    for text in ["a", '"q" \\', "é中🙂", ""]:
        event = fmt.logprobs_event(text, lps, include_usage)
        full = fmt.chunk(fmt.text_delta(text), None, include_usage, logprobs=json.loads(lps))
        assert event == sse_event(full)


def _frames(strings: TokenStrings, text: str, prompt_lps: list | None) -> list[TokenFrame]:
    """One frame per token of ``text`` with made-up logprobs (two tokens in the fourth)."""
    ids = _ids(strings, text)
    frames, seq, i = [], 0, 0
    while i < len(ids):
        n = 2 if seq == 3 else 1
        toks = ids[i : i + n]
        lps = [[-0.5 - t / 1000, 1 + t % 3, [[t, -0.25], [(t + 1) % 512, -0.75]]] for t in toks]
        frames.append(
            TokenFrame(
                seq,
                toks,
                strings._tok.decode(toks),
                logprobs=lps,
                prompt_logprobs=prompt_lps if seq == 0 else None,
            )
        )
        i += n
        seq += 1
    return frames


@pytest.mark.parametrize("kind", ["chat", "completion", "echo"])
def test_streamed_chunks_reassemble_to_the_whole_response(kind: str, strings: TokenStrings) -> None:
    prompt = [1, 50, 60]
    plps = [None, [-1.0, 2, [[7, -0.5], [50, -1.0]]], [-0.5, 1, [[60, -0.5], [7, -2.0]]]]
    frames = _frames(strings, "Stream me, then join me!", plps)
    text = "".join(f.text for f in frames)
    chat = kind == "chat"
    echo = "the prompt" if kind == "echo" else None

    def extra() -> ExtraOutput:
        return ExtraOutput(strings, LogprobsRenderer(strings, chat, 2), prompt, echo, True)

    whole_text, whole, plp = extra().full(frames, text)
    assert plp == prompt_logprobs(strings, prompt, plps)
    fmt = Formatter("chat" if chat else "completion", "x", "m")
    x = extra()
    chunks = [
        x.event(fmt, frames[i : i + 2], "".join(f.text for f in frames[i : i + 2]), False)
        for i in range(0, len(frames), 2)
    ]
    bodies = [json.loads(c[6:-4])["choices"][0] for c in chunks]
    got_text = "".join(b["delta"]["content"] if chat else b["text"] for b in bodies)
    assert got_text == whole_text == (echo or "") + text
    n_out = sum(len(f.token_ids) for f in frames)
    if chat:
        content = [e for b in bodies for e in b["logprobs"]["content"]]
        assert content == whole["content"]
        assert len(content) == n_out
        return
    # text offsets: vLLM's (a chunk starts after the text sent before it, a token after
    # the token before it), which agree where the text is the tokens' strings, not echoed
    keys = ["tokens", "token_logprobs", "top_logprobs"] + ([] if echo else ["text_offset"])
    for key in keys:
        assert [v for b in bodies for v in b["logprobs"][key]] == whole[key], key
    if echo:
        assert whole["token_logprobs"][:3] == [None, -1.0, -0.5]  # the echoed prompt's
        assert whole["top_logprobs"][1] == {strings.text(7): -0.5, strings.text(50): -1.0}
    assert len(whole["tokens"]) == (len(prompt) if echo else 0) + n_out


def test_a_token_without_text_rides_with_the_next_chunk(strings: TokenStrings) -> None:
    """Its text is held back (it ends inside a character): no event of its own, its
    logprobs come with the next event that has text, or with the stream's last one."""
    ids = _ids(strings, "é中")
    lp = [-1.0, 1, [[ids[0], -1.0]]]
    fmt = Formatter("chat", "x", "m")
    x = ExtraOutput(strings, LogprobsRenderer(strings, True, 1), [1], None, False)
    assert x.event(fmt, [TokenFrame(0, ids[:1], "", logprobs=[lp])], "", False) == b""
    ev = x.event(fmt, [TokenFrame(1, ids[1:2], "é", logprobs=[lp])], "é", False)
    content = json.loads(ev[6:-4])["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [strings.text(i) for i in ids[:2]]
    assert x.event(fmt, [TokenFrame(2, ids[2:3], "", logprobs=[lp])], "", False) == b""
    last = x.event(fmt, [TokenFrame(3, ids[3:4], "", done=True, logprobs=[lp])], "", False)
    body = json.loads(last[6:-4])["choices"][0]
    assert body["delta"]["content"] == ""
    assert [e["token"] for e in body["logprobs"]["content"]] == [strings.text(i) for i in ids[2:4]]


@pytest.mark.parametrize("kind", ["chat", "completion", "echo"])
def test_token_ids_ride_the_chunks_held_ones_included(kind: str, strings: TokenStrings) -> None:
    """vLLM's return_token_ids: each chunk's output ids (a token whose text is held back
    rides with the next chunk's, as its logprobs do), the prompt's on the first chunk (the
    role's, in chat: ExtraOutput.open) or the whole body's; an echo's prompt is not output."""
    ids = _ids(strings, "é中 and more")
    prompt = [1, 50, 60]
    chat = kind == "chat"
    fmt = Formatter("chat" if chat else "completion", "x", "m")
    echo = "the prompt" if kind == "echo" else None

    def extra() -> ExtraOutput:
        return ExtraOutput(strings, None, prompt, echo, False, ids=True)

    x = extra()
    # the first token is half of "é": its text comes with the second's
    texts = ["", "é"] + [strings._tok.decode(ids[: i + 1])[len(strings._tok.decode(ids[:i])):]
                         for i in range(2, len(ids))]  # fmt: skip
    frames = [TokenFrame(i, [t], texts[i], done=i == len(ids) - 1) for i, t in enumerate(ids)]
    bodies = [json.loads(ev[6:-4]) for f in frames if (ev := x.event(fmt, [f], f.text, False))]
    assert [t for b in bodies for t in b["choices"][0]["token_ids"]] == ids
    assert len(bodies) < len(frames)  # the held byte went out with the next text
    firsts = [b["choices"][0].get("prompt_token_ids") for b in bodies]
    assert firsts[1:] == [None] * (len(bodies) - 1)
    assert firsts[0] == (None if chat else prompt)
    if chat:
        assert extra().open({"choices": []})["prompt_token_ids"] == prompt
    whole = fmt.choice(0, "t", "stop", None)
    extra().whole_ids(whole, frames)
    assert whole["token_ids"] == ids
    body = fmt.whole([whole], {})
    where = body if chat else body["choices"][0]
    assert where["prompt_token_ids"] == prompt
    assert chat == ("prompt_token_ids" not in body["choices"][0])
