"""OpenAI's logprobs shapes, rendered from the logprobs the frames carry
(:data:`kvbm.protocol.Logprob`: ``[logprob, rank, [[token id, logprob], ...]]``).

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}``, the top ones most likely first;
* completions: ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``, each
  ``top_logprobs`` entry a ``{token: logprob}`` object of the most likely tokens, most likely
  first, then the sampled token if it is not among them (OpenAI's "up to logprobs + 1");
  an echoed prompt's first token has ``null`` for both, as nothing predicts it;
* vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first) or ``{"<id>":
  {"logprob", "rank", "decoded_token"}}``, the prompt's token first, then the most likely.

A token's string is the token decoded alone, special tokens kept (as vLLM shows it: a
token that ends inside a UTF-8 character shows U+FFFD), and ``bytes`` its UTF-8 encoding.

Streams render on every token, so the JSON is written here as text from parts cached per
token id (its string and bytes never change), not built as dicts and encoded: a chunk's
logprobs cost a few string joins (docs/performance.md, "Logprobs: cost at c=16"). A whole
response parses the same text, so a stream's chunks reassemble to exactly its body.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from api.protocol import ChatCompletionRequest, CompletionRequest
from api.sse import Formatter, json_line, sse_event
from kvbm.protocol import LOGPROB_FLOOR, Sampling, TokenFrame


class TokenStrings:
    """Token id -> its string and JSON parts, decoded once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._text: dict[int, str] = {}
        self._chat: dict[int, str] = {}  # '"token":"...","bytes":[...]'
        self._key: dict[int, str] = {}  # '"..."'

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = self._tok.decode([tid], skip_special_tokens=False)
        return s

    def chat(self, tid: int) -> str:
        part = self._chat.get(tid)
        if part is None:
            s = self.text(tid)
            b = list(s.encode("utf-8", errors="replace"))
            part = self._chat[tid] = f'"token":{json_line(s)},"bytes":{json_line(b)}'
        return part

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def key(self, tid: int) -> str:
        k = self._key.get(tid)
        if k is None:
            k = self._key[tid] = json_line(self.text(tid))
        return k


class TokenIdStrings(TokenStrings):
    """Each token's string as ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``):
    a token that is no valid UTF-8 alone is still told apart from its neighbours."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # it decodes nothing

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = f"token_id:{tid}"
        return s


ID_STRINGS = TokenIdStrings()


class LogprobsRenderer:
    """One request's logprobs, chunk by chunk (``top``: how many top logprobs it asked
    for per token). Completions keep the text offset across chunks, as vLLM counts it: a
    chunk's first token sits after the text of the chunks before, each next one after the
    string of the token before it."""

    def __init__(self, strings: TokenStrings, chat: bool, top: int) -> None:
        self.strings = strings
        self.chat = chat
        self.top = top
        self.offset = 0  # completions: characters of text sent before this chunk

    def render(self, token_ids: list[int], logprobs: list, text: str = "") -> str:
        """The ``logprobs`` JSON of a chunk with these tokens (``logprobs``: one Logprob, or
        None for a prompt's first token, per token) and this text."""
        if self.chat:
            return self._chat(token_ids, logprobs)
        out = self._completion(token_ids, logprobs)
        self.offset += len(text)
        return out

    def full(self, token_ids: list[int], logprobs: list, text: str = "") -> dict:
        """The same, as the object a whole response carries."""
        return json.loads(self.render(token_ids, logprobs, text))

    # ----------------------------------------------------------------------------------
    def _chat(self, token_ids: list[int], logprobs: list) -> str:
        s, top = self.strings, self.top
        items = []
        for tid, lp in zip(token_ids, logprobs, strict=True):
            if lp is None:  # none came (an engine that sent none): OpenAI's -inf stand-in
                lp = [LOGPROB_FLOOR, 0, []]
            tops = ",".join(f'{{{s.chat(t)},"logprob":{x!r}}}' for t, x in lp[2][:top])
            items.append(f'{{{s.chat(tid)},"logprob":{lp[0]!r},"top_logprobs":[{tops}]}}')
        return '{"content":[' + ",".join(items) + "]}"

    def _completion(self, token_ids: list[int], logprobs: list) -> str:
        s, top = self.strings, self.top
        offsets, values, tokens, tops = [], [], [], []
        at = self.offset
        for tid, lp in zip(token_ids, logprobs, strict=True):
            offsets.append(str(at))
            at += len(s.text(tid))
            tokens.append(s.key(tid))
            if lp is None:
                values.append("null")
                tops.append("null")
                continue
            values.append(repr(lp[0]))
            seen: set[str] = set()
            pairs = []
            for t, x in [*lp[2][:top], [tid, lp[0]]]:
                k = s.key(t)
                if k not in seen:  # tokens with the same string: the likeliest one's
                    seen.add(k)
                    pairs.append(f"{k}:{x!r}")
            tops.append("{" + ",".join(pairs) + "}")
        return (f'{{"text_offset":[{",".join(offsets)}],'
                f'"token_logprobs":[{",".join(values)}],'
                f'"tokens":[{",".join(tokens)}],'
                f'"top_logprobs":[{",".join(tops)}]}}')  # fmt: skip


class ExtraOutput:
    """What a request asked for on top of its text: its tokens' logprobs, its prompt's
    (vLLM's ``prompt_logprobs``; whole responses only, as in vLLM), its prompt echoed before
    the completion (completions' ``echo``, with the prompt's logprobs when it asked for
    logprobs). The first frame carries the prompt's logprobs."""

    def __init__(self, strings: TokenStrings, renderer: LogprobsRenderer | None,
                 prompt_ids: list[int], echo: str | None, prompt_lps: bool,
                 ids: bool = False) -> None:  # fmt: skip
        self.strings = strings
        self.renderer = renderer
        self.prompt_ids = prompt_ids
        self.echo = echo  # the prompt's text, until it went out
        self.prompt_lps = prompt_lps
        # vLLM's return_token_ids: each chunk's token ids, the prompt's in the first
        self.ids = ids
        self._opened = False  # completions: the prompt's ids went out on a chunk
        # tokens whose text is still to come: for logprobs (an echo's prompt included) and
        # as output ids
        self._held: tuple[list[int], list, list[int]] = ([], [], [])

    def open(self, chunk: dict) -> dict:
        """Chat's first chunk (the role's), with the prompt's ids where they were asked for
        (vLLM: on the chunk, in chat)."""
        if self.ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        return chunk

    def event(self, fmt: Formatter, frames: list[TokenFrame], text: str,
              include_usage: bool, index: int = 0) -> bytes:  # fmt: skip
        """The SSE event of a stream's frames (text ``text``). A token whose text is held
        back (it ends inside a character, or may begin a stop string) waits for the next
        event with text, or the stream's end: its logprobs ride with the text it begins,
        one event fewer (vLLM sends it alone, with empty content)."""
        tokens, lps = frame_tokens(frames) if self.renderer is not None or self.ids else ([], [])
        out_ids = tokens  # the output's own (an echoed prompt's join the logprobs only)
        if self.echo is not None:
            text = self.echo + text
            self.echo = None
            if self.renderer is not None:
                tokens, lps = self._with_prompt(frames, tokens, lps)
        if self.renderer is None and not self.ids:
            return fmt.text_event(text, include_usage, index) if text else b""
        held_tokens, held_lps, held_ids = self._held
        if held_tokens:
            tokens, lps, out_ids = held_tokens + tokens, held_lps + lps, held_ids + out_ids
        if not text and not (frames and frames[-1].done):
            self._held = (tokens, lps, out_ids)
            return b""
        self._held = ([], [], [])
        if not tokens and not text:
            return b""
        if not self.ids:
            return fmt.logprobs_event(text, self.renderer.render(tokens, lps, text),  # type: ignore[union-attr]
                                      include_usage, index)  # fmt: skip
        logprobs = self.renderer.full(tokens, lps, text) if self.renderer is not None else None
        chunk = fmt.chunk(fmt.text_delta(text), None, include_usage, index=index,
                          logprobs=logprobs)  # fmt: skip
        return sse_event(self._with_ids(fmt, chunk, out_ids))

    def _with_ids(self, fmt: Formatter, chunk: dict, out_ids: list[int]) -> dict:
        """``chunk`` with its tokens' ids; a completion's first with the prompt's too (on
        the choice, where vLLM puts them in completions)."""
        choice = chunk["choices"][0]
        choice["token_ids"] = out_ids
        if not fmt.chat and not self._opened:
            choice["prompt_token_ids"] = self.prompt_ids
        self._opened = True
        return chunk

    def beside_tools(self, fmt: Formatter, frames: list[TokenFrame], include_usage: bool,
                     index: int = 0) -> bytes:  # fmt: skip
        """A tool-parsed stream's logprobs: its frames' tokens in a chunk of their own, with
        an empty delta after the batch's content and tool-call deltas (those are parsed from
        the text, not cut where the tokens end), so every token's logprob goes out once."""
        if self.renderer is None and not self.ids:
            return b""
        tokens, lps = frame_tokens(frames)
        if not tokens:
            return b""
        logprobs = self.renderer.full(tokens, lps) if self.renderer is not None else None
        chunk = fmt.chunk(fmt.empty_delta(), None, include_usage, index=index, logprobs=logprobs)
        return sse_event(self._with_ids(fmt, chunk, tokens) if self.ids else chunk)

    def whole_ids(self, choice: dict, frames: list[TokenFrame]) -> None:
        """A whole response's choice with its token ids and the prompt's, where asked for
        (chat's prompt ids move onto the body: :meth:`api.sse.Formatter.whole`)."""
        if self.ids:
            choice["token_ids"] = frame_tokens(frames)[0]
            choice["prompt_token_ids"] = self.prompt_ids

    def full(self, frames: list[TokenFrame], text: str) -> tuple[str, dict | None, list | None]:
        """A whole response's (text, logprobs, prompt logprobs) from all its frames."""
        tokens, lps = frame_tokens(frames)
        if self.echo is not None:
            text = self.echo + text
            tokens, lps = self._with_prompt(frames, tokens, lps)
        logprobs = self.renderer.full(tokens, lps, text) if self.renderer is not None else None
        plps = frames[0].prompt_logprobs if frames else None
        prompt = None
        if self.prompt_lps and plps is not None:
            prompt = prompt_logprobs(self.strings, self.prompt_ids, plps)
        return text, logprobs, prompt

    def _with_prompt(self, frames: list[TokenFrame], tokens: list[int],
                     lps: list) -> tuple[list[int], list]:  # fmt: skip
        plps = (frames[0].prompt_logprobs if frames else None) or [None] * len(self.prompt_ids)
        return self.prompt_ids + tokens, plps + lps


def extra_output(strings: TokenStrings, req: ChatCompletionRequest | CompletionRequest,
                 sampling: Sampling, prompt_ids: list[int], as_ids: bool = False,
                 prompt: str | list[int] | None = None) -> ExtraOutput | None:  # fmt: skip
    """What ``req`` asks for on top of its text; ``None``: nothing (the plain path).
    ``as_ids``: the deployment's return_tokens_as_token_ids (the request's overrides it).
    ``prompt``: a completion's prompt as sent (one of a batch's), which ``echo`` repeats
    (a string as it came, token ids decoded)."""
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        echo = prompt if isinstance(prompt, str) else \
            strings.decode(prompt_ids, req.skip_special_tokens)  # fmt: skip
    if sampling.logprobs is None and sampling.prompt_logprobs is None and echo is None \
            and not req.return_token_ids:  # fmt: skip
        return None
    chat = isinstance(req, ChatCompletionRequest)
    renderer = None
    if sampling.logprobs is not None:
        named = req.return_tokens_as_token_ids
        renderer = LogprobsRenderer(ID_STRINGS if (as_ids if named is None else named)
                                    else strings, chat, sampling.logprobs)  # fmt: skip
    return ExtraOutput(strings, renderer, prompt_ids, echo, sampling.prompt_logprobs is not None,
                       req.return_token_ids)  # fmt: skip


def frame_tokens(frames: list[TokenFrame]) -> tuple[list[int], list]:
    """The frames' token ids and one logprob (or None) per token."""
    tokens: list[int] = []
    lps: list = []
    for f in frames:
        tokens += f.token_ids
        lps += f.logprobs if f.logprobs is not None else [None] * len(f.token_ids)
    return tokens, lps


def prompt_logprobs(strings: TokenStrings, prompt_ids: list[int], logprobs: list) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None (nothing predicts the first) or
    ``{str(id): {"logprob", "rank", "decoded_token"}}``, the prompt's token first, then the
    most likely (ranked 1, 2, ...)."""
    out: list = []
    for tid, lp in zip(prompt_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": lp[0], "rank": lp[1], "decoded_token": strings.text(tid)}}
        for rank, (t, x) in enumerate(lp[2], start=1):
            entry.setdefault(str(t), {"logprob": x, "rank": rank,
                                      "decoded_token": strings.text(t)})  # fmt: skip
        out.append(entry)
    return out
