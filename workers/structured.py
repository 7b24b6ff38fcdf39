"""Structured outputs in the reference engine, with xgrammar (vLLM's default backend).

A constrained request (``Sampling.structured``, a :class:`kvbm.protocol.StructuredOutput`)
goes through three steps here:

* **Its grammar.** Compiled from the spec on a compile thread (xgrammar lets go of the GIL
  while it compiles) and kept in a bounded LRU keyed by the spec (``StructuredOutput.key``),
  so equal specs compile once. Until its grammar is ready the request waits here, outside
  the scheduler, while the others keep stepping. A spec xgrammar cannot compile ends the
  request on its first frame with ``invalid_structured_output``, naming the problem and
  the request field it came from.
* **Its matcher** (:class:`Constraint`), built once the grammar is ready, after the tokens
  the request already has: a disaggregated decode's first token (sampled by the prefill
  worker), a migrated stream's output so far.
* **Every step's mask.** :meth:`StructuredOutputs.mask`, called on the batch's logits right
  before sampling, fills the constrained rows' token bitmasks and sets every token their
  grammar forbids to -inf; the output path then hands each sampled token to the matcher
  (:meth:`Constraint.accept`), and the sequence stops ("stop") once the grammar has ended.
  The end-of-sequence token is allowed only where the grammar may end. Unconstrained rows
  are not touched.
* **Thinking first.** A reasoning model's request (``StructuredOutput.after``: its end of
  thinking, ``</think>``) thinks unconstrained, as vLLM lets it with a reasoning parser:
  its matcher only watches for that end, and the mask and the grammar apply from the token
  after it.

JSON is generated without free whitespace between tokens unless the spec asks for it
(``any_whitespace``; vLLM's ``disable_any_whitespace``), with "," and ":" as separators, as
vLLM's xgrammar backend writes it: a schema with bounded strings, arrays and numbers then
always finishes, even on a model with random weights.

xgrammar brings torch and transformers: it is imported on first use, on the compile thread,
so an engine that never sees a constrained request never loads it. torch-free to import.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbm.protocol import StructuredOutput

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

    from workers.engine_api import EngineRequest

log = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept (xgrammar's own estimate of their size)
CACHE_ENTRIES = 1024  # and at most this many specs (failed ones included)
COMPILE_THREADS = 2


# ======================================================================================
# What the engine uses
# ======================================================================================


@dataclass(slots=True)
class Constraint:
    """A sequence's place in its grammar (an xgrammar ``GrammarMatcher``); used on the
    engine loop's thread only."""

    matcher: Any
    stop_token_ids: frozenset[int]  # the grammar ends on one of these (and only then)
    error: str | None = None  # set when a token the grammar forbids came (the output ends)
    # the end of thinking the grammar waits for (StructuredOutput.after); None once it is
    # out, or from the start: the grammar applies
    gate: list[int] | None = None
    tail: list[int] | None = None  # the output's last tokens while the gate is shut

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (the thinking is over)."""
        return self.gate is None

    def accept(self, token: int) -> bool:
        """Advance by ``token``; True when the output is over: the grammar has ended (its
        stop token came), or ``token`` was not allowed (``error`` says so). Before the
        gate's end of thinking is out, tokens are thinking: only watched for it."""
        if self.gate is not None:
            tail = self.tail if self.tail is not None else []
            tail.append(token)
            self.tail = tail[-len(self.gate) :]
            if self.tail == self.gate:
                self.gate = self.tail = None
            return False
        if self.matcher.accept_token(token):
            return token in self.stop_token_ids and self.matcher.is_terminated()
        self.error = f"token {token} does not follow the request's grammar"
        log.error("structured output: %s", self.error)
        return True


class StructuredOutputs:
    """Grammars, matchers and masks for one engine (its tokenizer and logits width).

    The engine loop's thread calls everything here; only compiles run elsewhere (their
    results come back through :meth:`ready`, the waker says when)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
        cache_bytes: int = CACHE_BYTES, cache_entries: int = CACHE_ENTRIES,
        threads: int = COMPILE_THREADS,
    ) -> None:  # fmt: skip
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.cache = GrammarCache(cache_bytes, cache_entries)
        self.threads = threads
        self.compiles = 0  # compiles started (cache misses)
        self._pool: ThreadPoolExecutor | None = None
        self._held: dict[str, EngineRequest] = {}  # waiting for their grammar, by id
        self._inflight: dict[str, list[str]] = {}  # spec key -> request ids waiting on it
        self._done: deque[tuple[str, object]] = deque()  # (key, grammar or error): compiled
        self._waker: Callable[[], None] | None = None
        self._bitmask: torch.Tensor | None = None

    # --- requests waiting for their grammar ------------------------------------------------
    def admit(self, req: EngineRequest) -> Constraint | str | None:
        """``req``'s constraint now if its grammar is cached, or why it cannot have one (an
        error message); ``None``: it waits here and comes back from :meth:`ready`."""
        spec = req.params.structured
        assert spec is not None, "admit() is for constrained requests"
        key = spec.key()
        grammar = self.cache.get(key)
        if grammar is not None:
            return self._constraint(req, grammar)
        self._held[req.request_id] = req
        waiting = self._inflight.get(key)
        if waiting is not None:  # the same spec is compiling already
            waiting.append(req.request_id)
            return None
        self._inflight[key] = [req.request_id]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar")
        self.compiles += 1
        self._pool.submit(self._compile, key, spec)
        return None

    def ready(self) -> list[tuple[EngineRequest, Constraint | str]]:
        """Held requests whose grammar has compiled since the last call, each with its
        constraint or why it cannot have one."""
        out: list[tuple[EngineRequest, Constraint | str]] = []
        while self._done:
            key, grammar = self._done.popleft()
            self.cache.put(key, grammar)
            for rid in self._inflight.pop(key, []):
                req = self._held.pop(rid, None)
                if req is not None:  # not aborted meanwhile
                    out.append((req, self._constraint(req, grammar)))
        return out

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def pending(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._held)

    def drop(self, request_id: str) -> EngineRequest | None:
        """Forget a held request (aborted); ``None`` if it is not held here."""
        return self._held.pop(request_id, None)

    def drop_all(self) -> list[EngineRequest]:
        held, self._held = list(self._held.values()), {}
        return held

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """``waker`` is called (from a compile thread) when a grammar has compiled."""
        self._waker = waker

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- every step ----------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, seqs: Sequence[Any]) -> None:
        """Set the logits each constrained row's grammar forbids next to -inf, in place
        (``logits[i]`` is ``seqs[i]``'s; a sequence is constrained when its ``constraint``
        is set). Rows without one are left as they are."""
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None and s.constraint.active]
        if not rows:
            return
        import torch

        words = -(-logits.shape[-1] // 32)
        bm = self._bitmask
        if bm is None or bm.shape[0] < len(seqs) or bm.shape[1] != words:
            bm = self._bitmask = torch.empty((max(len(seqs), 16), words), dtype=torch.int32)
        # one call for all rows: a call per row costs more than the rows' fill
        # (docs/performance.md, "Structured outputs: the mask per step")
        matchers = [seqs[i].constraint.matcher for i in rows]
        self.compiler.batch.batch_fill_next_token_bitmask(matchers, bm, rows)
        apply_bitmask(logits, bm, rows)

    # ----------------------------------------------------------------------------------
    def _compile(self, key: str, spec: StructuredOutput) -> None:
        """A compile thread: the grammar, or why there is none."""
        try:
            result: object = self.compiler.compile(spec)
        except GrammarError as e:
            result = str(e)  # the problem, cached; each request's message names its field
        except Exception as e:  # noqa: BLE001 - whatever it is, the request must end
            log.exception("compiling a %s grammar failed", spec.kind)
            result = f"{type(e).__name__}: {e}"
        self._done.append((key, result))
        if self._waker is not None:
            self._waker()

    def _constraint(self, req: EngineRequest, grammar: object) -> Constraint | str:
        """A matcher for ``req`` that has seen the output tokens it already has; or why
        there is none (``grammar`` is why its spec did not compile)."""
        if isinstance(grammar, str):
            return f"{_field(req.params.structured)} could not be compiled: {grammar}"  # type: ignore[arg-type]
        c = Constraint(self.compiler.matcher(grammar), self.compiler.stops,
                       gate=req.params.structured.after)  # type: ignore[union-attr]  # fmt: skip
        done = list(req.resumed.output_token_ids) if req.resumed is not None else []
        if req.imported is not None:
            done.append(req.imported.first_token)
        for i, tok in enumerate(done):
            if c.accept(tok) and (c.error is not None or i < len(done) - 1):
                return (f"output token {i} ({tok}) does not follow the request's grammar: "
                        "cannot continue it")  # fmt: skip
        return c


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``logits[r, t] = -inf`` wherever bit ``t`` of ``bitmask[r]`` is 0, for ``r`` in
    ``rows`` (bit ``t`` is bit ``t % 32`` of word ``t // 32``). xgrammar's kernel on CPU;
    torch elsewhere (xgrammar's GPU path needs triton, which is not installed)."""
    import torch

    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16,
                                                         torch.float16):  # fmt: skip
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )

        apply_token_bitmask_inplace_cpu(logits, bitmask, vocab, rows)
    else:
        mask_with_torch(logits, bitmask, rows)


def mask_with_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """:func:`apply_bitmask` in torch operations (any device, any dtype)."""
    import torch

    vocab = logits.shape[-1]
    with torch.inference_mode():  # the model's logits are inference tensors
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        words = bitmask[rows].to(logits.device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


# ======================================================================================
# Compiling and caching grammars
# ======================================================================================


def grammar_text(spec: StructuredOutput) -> str:
    """``spec`` as the EBNF grammar the reference engine compiles (xgrammar's, with the fixes
    below): what the vLLM engine hands vLLM, so both enforce the same grammar. Raises
    :class:`GrammarError` saying why when ``spec`` has none."""
    import xgrammar as xgr

    try:
        return str(GrammarCompiler._grammar(xgr, spec))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own
        raise GrammarError(_problem(e)) from e


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message is xgrammar's reason."""


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and logits width, built on first use (it
    imports xgrammar). Thread-safe."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.stops = frozenset(stop_token_ids)
        self._xgr: Any = None  # (the xgrammar module, its GrammarCompiler)
        self._compiler: Any = None
        self._batch: Any = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Any:
        """``spec``'s compiled grammar (an xgrammar ``CompiledGrammar``); raises
        :class:`GrammarError` saying why when it does not compile."""
        xgr, compiler = self._load()
        try:
            return compiler.compile_grammar(self._grammar(xgr, spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own
            raise GrammarError(_problem(e)) from e

    @staticmethod
    def _grammar(xgr: Any, spec: StructuredOutput) -> Any:
        """``spec`` as an xgrammar ``Grammar``."""
        G = xgr.Grammar
        if spec.json_schema is not None or spec.json_object:
            schema = spec.json_schema if spec.json_schema is not None else '{"type": "object"}'
            # the most compact JSON (vLLM's separators when it disables free whitespace)
            seps = None if spec.any_whitespace else (",", ":")
            return _fixed(G, G.from_json_schema(schema, any_whitespace=spec.any_whitespace,
                                                separators=seps), True)  # fmt: skip
        if spec.regex is not None:
            return _fixed(G, G.from_regex(spec.regex), False)
        if spec.choice is not None:
            return G.from_ebnf(choice_grammar(spec.choice))
        if spec.grammar is not None:
            # EBNF (xgrammar's dialect: `root ::= ...`); a Lark grammar (`start: ...`) too,
            # as vLLM takes it
            text = spec.grammar
            return _fixed(G, G.from_ebnf(text) if "::=" in text else G.from_lark(text), False)
        assert spec.structural_tag is not None, "a StructuredOutput sets one kind"
        # xgrammar's structural tag ({"type": "structural_tag", "format": ...}), or the older
        # form vLLM's OpenAI server takes too ({"structures": [...], "triggers": [...]})
        tag = json.loads(spec.structural_tag)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]  # fmt: skip
            return _fixed(G, G.from_structural_tag(items, tag.get("triggers", [])), True)
        return _fixed(G, G.from_structural_tag(spec.structural_tag), True)

    def matcher(self, grammar: Any) -> Any:
        return self._xgr.GrammarMatcher(grammar)

    @property
    def batch(self) -> Any:
        """xgrammar's batch matcher (fills many rows' bitmasks in one call), on this
        thread: the engine's core is its only one."""
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher(1)
        return self._batch

    def _vocabulary(self) -> list[str]:
        """Each token id's text as the tokenizer stores it; "" for special tokens and ids
        the tokenizer does not have (xgrammar never allows those but its stop tokens)."""
        vocab = [""] * self.vocab_size
        for text, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                vocab[i] = text
        for i, added in self.tokenizer.get_added_tokens_decoder().items():
            if added.special and i < self.vocab_size:
                vocab[i] = ""
        return vocab

    def _load(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer)
                found = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # the same, with the special tokens (<unk>, <s>, <image>, ...) as xgrammar's
                # special tokens: it reads them as their text otherwise ("<unk>" in a JSON
                # string), which the detokenizer then drops from the output
                info = xgr.TokenizerInfo(
                    self._vocabulary(), found.vocab_type, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids, add_prefix_space=found.add_prefix_space,
                )  # fmt: skip
                # no cache of its own: GrammarCache keeps what was compiled, bounded
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._xgr = xgr
                log.info("xgrammar ready (vocabulary %d, stop tokens %s)", self.vocab_size,
                         self.stop_token_ids)  # fmt: skip
            return self._xgr, self._compiler


class GrammarCache:
    """Compiled grammars (or why a spec does not compile) by spec key, least recently used
    first out, bounded in bytes and entries. Engine loop's thread only."""

    def __init__(self, max_bytes: int = CACHE_BYTES, max_entries: int = CACHE_ENTRIES) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, tuple[object, int]] = OrderedDict()

    def get(self, key: str) -> object | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, grammar: object) -> None:
        size = 0 if isinstance(grammar, str) else int(grammar.memory_size_bytes)  # type: ignore[attr-defined]
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (grammar, size)
        self.bytes += size
        while len(self._items) > 1 and (self.bytes > self.max_bytes
                                        or len(self._items) > self.max_entries):  # fmt: skip
            _, (_, gone) = self._items.popitem(last=False)
            self.bytes -= gone

    def __len__(self) -> int:
        return len(self._items)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of ``choices`` (JSON's string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Two fixes to xgrammar 0.2.8's grammars, made on their text (it prints EBNF it can read):
# * a string with minLength / maxLength is made of the class [^"\\\r\n], which lets raw
#   control characters in (a tab, U+0006): JSON forbids them and strict parsers (Python's
#   json, pydantic) reject them. Such strings get the class of its unbounded ones (escapes
#   stay unavailable in them: mlc-ai/xgrammar#800, open at 0.2.8);
# * a negated class ([^...]) matches the UTF-16 surrogates U+D800..U+DFFF, whose UTF-8
#   bytes are not valid UTF-8 (the detokenizer shows them as U+FFFD: a string of 6
#   characters becomes 8). Every negated class leaves them out.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\]"
_SURROGATES = r"\ud800-\udfff"
# a string literal (left alone), or a character class (a negated one is changed)
_PIECE = re.compile(r'("(?:\\.|[^"\\])*")|(\[(?:\\.|[^\\\]])*\])')
# Its printer writes a character as \xHH and its parser reads as many hex digits as follow
# \x: "ße" prints as \xdfe and reads back as U+0DFE; \u00HH reads back as written.
_HEX_ESCAPE = re.compile(r"\\(\\|x([0-9a-fA-F]{2}))")


def _fixed(G: Any, grammar: Any, json_strings: bool) -> Any:
    """``grammar`` with both fixes (``json_strings``: it was made from a JSON schema); as it
    was if the fixed text does not read back exactly (never seen: a safety net)."""
    text = str(grammar)
    new = text.replace(_BOUNDED_CHAR, _JSON_CHAR) if json_strings else text
    new = _PIECE.sub(_no_surrogates, new)
    if new == text:
        return grammar
    exact = _HEX_ESCAPE.sub(lambda m: "\\\\" if m[1] == "\\" else "\\u00" + m[2], new)
    fixed = G.from_ebnf(exact)
    if str(fixed) != new:
        log.warning("a grammar did not read back exactly: kept as xgrammar made it")
        return grammar
    return fixed


def _no_surrogates(m: re.Match[str]) -> str:
    cls = m[2]
    if cls is None or not cls.startswith("[^") or _SURROGATES in cls:
        return m[0]
    return cls[:-1] + _SURROGATES + "]"


# ----------------------------------------------------------------------------------------
_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[04:07:18] /project/cpp/x.cc:42: "
_CHECK = re.compile(r"^Check failed: .*? is false:\s*")


def _problem(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CHECK.sub("", _SOURCE.sub("", text))


def _field(spec: StructuredOutput) -> str:
    return spec.param or f"the structured output's {spec.kind}"
