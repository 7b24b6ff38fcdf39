"""IncrementalDetokenizer on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from workers.detokenizer import IncrementalDetokenizer

MULTIBYTE = "héllo 東京 🙂 Über naïve — ∑ π ∞ 🚀!"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text  # round trip, so expectations below are exact
    return ids


def _run(d: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    for i in ids:
        st = d.step(i)
        deltas.append(st.text)
        if st.stop is not None:
            return deltas, st.stop
    return deltas, None


def test_multibyte_chars_split_across_tokens_are_never_partial(tok: Tokenizer) -> None:
    ids = _ids(tok, MULTIBYTE)
    # the tokenizer really does split characters across tokens here
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 3
    d = IncrementalDetokenizer(tok, stop=[])
    deltas, stop = _run(d, ids)
    assert stop is None
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == MULTIBYTE
    assert d.finish() == ""
    assert d.text == MULTIBYTE


def test_deltas_concatenate_to_full_decode(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog.\ndef main():\n    return 0 東京"
    ids = [1, *_ids(tok, text), 2]  # bos/eos are skipped like tokenizer.decode does
    d = IncrementalDetokenizer(tok, stop=[])
    deltas, _ = _run(d, ids)
    assert "".join(deltas) + d.finish() == tok.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_kept_when_not_skipped(tok: Tokenizer) -> None:
    ids = [1, *_ids(tok, "hi"), 2]
    d = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=False)
    deltas, _ = _run(d, ids)
    out = "".join(deltas) + d.finish()
    assert out == tok.decode(ids, skip_special_tokens=False) == "<s>hi</s>"


def test_stop_string_cuts_text_before_it(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello, world! STOP here and more")
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas, stop = _run(d, ids)
    assert stop == "STOP"
    assert "".join(deltas) == "Hello, world! "
    assert d.text == "Hello, world! "
    assert d.finish() == ""  # nothing after the stop is ever released
    with pytest.raises(AssertionError):
        d.step(ids[-1])


def test_stop_string_spanning_two_tokens(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello, world! again")
    # "world" = " wor" + "ld": neither token contains it alone
    assert [tok.decode([i]) for i in ids[3:5]] == [" wor", "ld"]
    d = IncrementalDetokenizer(tok, stop=["world"])
    deltas, stop = _run(d, ids)
    assert stop == "world"
    assert len(deltas) == 5  # caught on the token that completes it
    assert "".join(deltas) == "Hello, "


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = _ids(tok, "abc xyz def")
    d = IncrementalDetokenizer(tok, stop=["def", "xyz", "c x"])
    deltas, stop = _run(d, ids)
    assert stop == "c x"
    assert "".join(deltas) == "ab"


def test_include_stop_str_keeps_the_stop_and_holds_nothing_back(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello, world! again")
    d = IncrementalDetokenizer(tok, stop=["world", "never-matches"], include_stop=True)
    deltas, stop = _run(d, ids)
    assert stop == "world"
    assert len(deltas) == 5  # caught on the token that completes it, " wor" + "ld"
    # every token's text went out as it came (nothing held back for a stop to come)
    assert deltas == [tok.decode([i]) for i in ids[:5]]
    assert "".join(deltas) == "Hello, world" == d.text
    assert d.finish() == ""


def test_include_stop_str_cuts_what_follows_the_stop_in_its_token(tok: Tokenizer) -> None:
    ids = _ids(tok, "abc xyz def")
    d = IncrementalDetokenizer(tok, stop=["c x"], include_stop=True)
    deltas, stop = _run(d, ids)
    assert stop == "c x"
    assert "".join(deltas) == "abc x"  # the token " xyz" completes it: "yz" is cut


def test_prefix_of_stop_is_held_until_disambiguated(tok: Tokenizer) -> None:
    prefix_ids = _ids(tok, "Hello, world! ")
    sto_ids = _ids(tok, "STO")
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    released = "".join(d.step(i).text for i in prefix_ids + sto_ids)
    # "STO" could still become "STOP": none of it may be out yet
    assert released == "Hello, world! "
    assert d.text == "Hello, world! STO"
    for i in _ids(tok, "MP ok"):  # "STOMP" is not a stop
        st = d.step(i)
        assert st.stop is None
        released += st.text
    # once "STOMP" rules the stop out, the held characters are released
    assert released.startswith("Hello, world! STOM")
    tail = d.finish()
    assert released + tail == "Hello, world! STOMP ok"
    assert d.finish() == ""


def test_finish_flushes_held_text(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello, world!")
    d = IncrementalDetokenizer(tok, stop=["never-matches"])
    deltas, stop = _run(d, ids)
    assert stop is None
    released = "".join(deltas)
    assert len(released) == len("Hello, world!") - (len("never-matches") - 1)
    assert released + d.finish() == "Hello, world!"


def test_finish_turns_unfinished_char_into_replacement(tok: Tokenizer) -> None:
    ids = _ids(tok, "a 🙂")
    d = IncrementalDetokenizer(tok, stop=[])
    deltas, _ = _run(d, ids[:-1])  # cut the emoji short
    assert "".join(deltas) == "a"
    tail = d.finish()
    assert "".join(deltas) + tail == tok.decode(ids[:-1])
    assert tail.endswith("\ufffd")


def test_check_stop_false_ignores_stop_strings(tok: Tokenizer) -> None:
    ids = _ids(tok, "STOP then")
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out = ""
    for i in ids:
        st = d.step(i, check_stop=False)
        assert st.stop is None
        out += st.text
    assert out + d.finish() == "STOP then"
