"""Incremental detokenization with stop strings.

Text is released only in whole UTF-8 characters (``tokenizers.decoders.DecodeStream``
buffers a token that ends mid-character), and — when stop strings are set — the last
``max(len(stop)) - 1`` characters are held back until they can no longer begin a stop
string, so a client never sees text that a later token turns into a stop. On a stop string
the text is cut just before it. ``finish()`` flushes what is held back (an unfinished
character becomes U+FFFD, as a full decode would show it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass(slots=True)
class DetokenizerStep:
    text: str  # newly released text
    stop: str | None = None  # the stop string that matched; the sequence should finish


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:  # fmt: skip
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip = skip_special_tokens
        self._stop = [s for s in stop if s]
        # a stop string may begin this many characters before a token's text
        self._back = max((len(s) for s in self._stop), default=1) - 1
        self._include = include_stop
        self._hold = 0 if include_stop else self._back  # characters held back
        self._ids: list[int] = []
        self._text = ""  # everything decoded so far (before any stop cut)
        self._sent = 0  # characters of _text already released
        self._done = False

    @property
    def text(self) -> str:
        return self._text[: self._sent] if self._done else self._text

    def prime(self, token_ids: list[int], emitted_chars: int) -> None:
        """Continue a stream another process started: replay its tokens, of whose text
        ``emitted_chars`` characters were already released."""
        for t in token_ids:
            self._ids.append(t)
            piece = self._stream.step(self._tok, t)
            if piece:
                self._text += piece
        assert emitted_chars <= len(self._text), "more text released than decoded"
        self._sent = emitted_chars

    def step(self, token_id: int, check_stop: bool = True) -> DetokenizerStep:
        assert not self._done, "step() after the detokenizer finished"
        self._ids.append(token_id)
        piece = self._stream.step(self._tok, token_id)
        if piece is None:
            return DetokenizerStep("")
        before = len(self._text)
        self._text += piece
        if self._stop and check_stop:
            start = max(0, before - self._back)
            hit = _find_first(self._text, self._stop, start)
            if hit is not None:
                cut, stop = hit
                if self._include:
                    cut += len(stop)
                out = self._text[self._sent : cut]
                self._sent = cut
                self._done = True
                return DetokenizerStep(out, stop)
        limit = len(self._text) - self._hold
        if limit <= self._sent:
            return DetokenizerStep("")
        out = self._text[self._sent : limit]
        self._sent = limit
        return DetokenizerStep(out)

    def finish(self) -> str:
        """Release whatever is still held back; call once when the sequence ends."""
        if self._done:
            return ""
        self._done = True
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if full.startswith(self._text):  # pending bytes of an unfinished character
            self._text = full
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out


def _find_first(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
