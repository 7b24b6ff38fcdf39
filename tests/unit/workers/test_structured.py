"""Structured outputs on the reference engine (tiny random-weight model, real xgrammar):
every schema of the corpus and every kind of spec gives output its grammar accepts and that
ends ("stop"); a spec that does not compile ends the request naming the problem and the
field; equal specs compile once; a request waiting for its grammar holds up no other;
prefill -> decode, a re-prefill's forced token and a resumed stream continue the matcher
and give the aggregated run's tokens; the bitmask paths agree."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from kvbm.protocol import Sampling, StructuredOutput
from tasks.settings import engine_config
from tests.unit.workers.test_disagg_engine import imported
from workers.engine import Engine
from workers.engine_api import (
    EngineRequest,
    RequestOutput,
    ResumedOutput,
)
from workers.structured import GrammarCache, apply_bitmask, mask_with_torch

CORPUS = json.loads((Path(__file__).parents[2] / "data" / "json_schemas.json").read_text())
CFG = dict(block_size=16, num_kv_blocks=1024, max_model_len=1024, max_num_seqs=128)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def make(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    engines: list[Engine] = []

    def new() -> Engine:
        engines.append(Engine.from_model_dir(tiny_model_dir, engine_config(**CFG)))  # type: ignore[arg-type]
        return engines[-1]

    yield new
    for e in engines:
        e.close()


@pytest.fixture(scope="module")
def engine(make) -> Engine:  # type: ignore[no-untyped-def]
    return make()


def _run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    """Run ``reqs`` to the end; while only grammars are compiling, wait for the waker."""
    woken = threading.Event()
    engine.set_waker(woken.set)
    out: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        refused = engine.add_request(r)
        if refused is not None:
            out[r.request_id].append(refused)
    while engine.has_unfinished:
        outs = engine.step()
        if not outs and engine.stalled:
            assert woken.wait(30), "a grammar never came"
            woken.clear()
        for o in outs:
            out.setdefault(o.request_id, []).append(o)
    engine.set_waker(None)
    st = engine.stats()
    assert st.blocks_used == 0 or st.blocks_pinned  # (a prefill's, until released)
    return out


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def _toks(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


_REQUEST_FIELDS = ("prefill_only", "forced_first_token", "imported", "resumed")


def _req(rid: str, prompt: list[int], spec: StructuredOutput, **kw: object) -> EngineRequest:
    """A constrained request (``kw``: sampling fields, and EngineRequest's own)."""
    own = {k: kw.pop(k) for k in _REQUEST_FIELDS if k in kw}
    kw.setdefault("max_tokens", 400)
    return EngineRequest(rid, prompt, Sampling(structured=spec, **kw), **own)  # type: ignore[arg-type]


def _schema(schema: dict, **kw: object) -> StructuredOutput:
    return StructuredOutput(json_schema=json.dumps(schema), **kw)  # type: ignore[arg-type]


def test_the_corpus_has_enough_schemas_and_each_is_valid() -> None:
    assert len(CORPUS) >= 50
    assert len({c["name"] for c in CORPUS}) == len(CORPUS)
    for c in CORPUS:
        jsonschema.Draft202012Validator.check_schema(c["schema"])


def test_every_corpus_schema_gives_json_that_validates(engine: Engine, tok: Tokenizer) -> None:
    """Greedy and seeded sampling, all in one batch: every output parses (strict JSON: no
    raw control characters), validates and ends on its own ("stop") within its budget."""
    reqs, schemas = [], {}
    for c in CORPUS:
        prompt = tok.encode(f"Give me {c['name']} as JSON").ids
        for temp in (0.0, 1.0):
            rid = f"{c['name']}-{temp}"
            reqs.append(_req(rid, prompt, _schema(c["schema"]), temperature=temp, seed=7))
            schemas[rid] = c["schema"]
    got = _run(engine, reqs)
    for rid, outs in got.items():
        text = _text(outs)
        assert outs[-1].finish_reason == "stop", (rid, outs[-1].finish_reason, text)
        jsonschema.validate(json.loads(text), schemas[rid])
        # no free whitespace: outside strings, only the separators' spaces
        bare = re.sub(r'"(?:\\.|[^"\\])*"', '""', text).replace(", ", ",").replace(": ", ":")
        assert not re.search(r"\s", bare), (rid, text)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutput(json_object=True),
         lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutput(regex=r"[a-z]{2,4}-[0-9]{3}"),
         lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", t)),
        (StructuredOutput(choice=["yes", "no", 'say "maybe"', "ünï\ncode"]),
         lambda t: t in ["yes", "no", 'say "maybe"', "ünï\ncode"]),
        (StructuredOutput(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | "zz"'),
         lambda t: re.fullmatch(r"\(([a-c]|zz)(,([a-c]|zz)){0,3}\)", t)),
        (StructuredOutput(grammar='start: "v" DIGIT DIGIT\nDIGIT: /[0-9]/'),  # Lark
         lambda t: re.fullmatch(r"v[0-9]{2}", t)),
        (StructuredOutput(structural_tag=json.dumps({
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<call>", "end": "</call>", "content": {
                "type": "json_schema", "max_whitespace_cnt": 1,
                "json_schema": {"type": "object", "required": ["n"],
                                "properties": {"n": {"type": "integer", "maximum": 9,
                                                     "minimum": 0}}}}}})),
         lambda t: re.fullmatch(r'<call>\{\s?"n"\s?:\s?[0-9]\s?\}</call>', t)),
    ],
)  # fmt: skip
def test_each_kind_of_spec_is_followed(engine: Engine, tok: Tokenizer, spec, check) -> None:  # type: ignore[no-untyped-def]
    prompts = [tok.encode(f"Answer number {i}:").ids for i in range(4)]
    reqs = [_req(f"r{i}", p, spec, temperature=[0.0, 1.0][i % 2], seed=i)
            for i, p in enumerate(prompts)]  # fmt: skip
    for rid, outs in _run(engine, reqs).items():
        assert outs[-1].finish_reason == "stop" and check(_text(outs)), (rid, _text(outs))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (_schema({"$ref": "#/$defs/missing"}, param="response_format.json_schema"),
         "Cannot find field $defs"),
        (StructuredOutput(regex="(ab", param="guided_regex"), "parenthesis is not closed"),
        (StructuredOutput(grammar="root ::= item", param="structured_outputs.grammar"),
         'Rule "item" is not defined'),
        (StructuredOutput(structural_tag=json.dumps({"type": "structural_tag",
                                                     "format": {"type": "bogus"}})),
         "Format type not recognized: bogus"),
    ],
)  # fmt: skip
def test_a_spec_that_does_not_compile_ends_the_request_naming_it(
    engine: Engine, spec: StructuredOutput, says: str
) -> None:
    (out,) = _run(engine, [_req("bad", [1, 5, 6], spec)])["bad"]
    assert out.finished and out.finish_reason == "error" and not out.token_ids
    assert out.error_code == "invalid_structured_output"
    assert out.error_param == spec.param
    assert says in out.error and "could not be compiled" in out.error, out.error
    assert "/project/cpp" not in out.error  # xgrammar's source location is cut off
    # the failure is cached too: the same spec again ends the same way, at once, naming the
    # field it came from this time
    compiles = engine.structured.compiles
    other = spec.model_copy(update={"param": "guided_other"})
    (again,) = _run(engine, [_req("bad2", [1, 5, 6], other)])["bad2"]
    assert engine.structured.compiles == compiles
    assert again.error_param == "guided_other"
    assert again.error.startswith("guided_other could not be compiled: ")
    assert again.error.split(": ", 1)[1] == out.error.split(": ", 1)[1]


def test_equal_specs_compile_once(make) -> None:  # type: ignore[no-untyped-def]
    engine = make()
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    reqs = [_req(f"r{i}", [1, 10 + i], _schema(schema, param=f"field{i}")) for i in range(5)]
    got = _run(engine, reqs)  # all five arrive while it compiles
    assert {_text(o) for o in got.values()} <= {'{"k":"a"}', '{"k":"b"}'}
    assert engine.structured.compiles == 1  # param is not part of the key
    _run(engine, [_req("later", [1, 99], _schema(schema))])
    assert engine.structured.compiles == 1 and engine.structured.cache.hits >= 1
    _run(engine, [_req("other", [1, 99], _schema(schema, any_whitespace=True))])
    assert engine.structured.compiles == 2


def test_a_request_waiting_for_its_grammar_holds_up_no_other(make) -> None:  # type: ignore[no-untyped-def]
    """The compile is held back (the real compiler behind a gate): the free request decodes
    meanwhile, the waiting one can be aborted, and the one let through finishes."""
    engine = make()
    gate = threading.Event()
    real = engine.structured.compiler.compile

    def gated(spec: StructuredOutput):  # type: ignore[no-untyped-def]
        assert gate.wait(30)
        return real(spec)

    engine.structured.compiler.compile = gated  # type: ignore[method-assign]
    spec = StructuredOutput(choice=["on", "off"])
    free = EngineRequest("free", [1, 7, 8], Sampling(max_tokens=8, temperature=0, ignore_eos=True))
    for r in (free, _req("held", [1, 9], spec), _req("gone", [1, 10], spec)):
        assert engine.add_request(r) is None
    steps = [engine.step() for _ in range(8)]
    assert [o.request_id for s in steps for o in s] == ["free"] * 8
    assert engine.structured.pending == 2 and engine.has_unfinished
    aborted = engine.abort("gone")
    assert aborted is not None and aborted.finish_reason == "abort"
    gate.set()
    got = _run(engine, [])
    assert set(got) == {"held"}
    assert _text(got["held"]) in ("on", "off") and got["held"][-1].finish_reason == "stop"


def test_prefill_decode_forced_and_resumed_runs_continue_the_grammar(make, tok) -> None:  # type: ignore[no-untyped-def]
    """The aggregated run's tokens, from a decode engine continuing a prefill engine's first
    token, from a re-prefill forced to it, and from a stream resumed after k tokens."""
    agg, pre, dec = make(), make(), make()
    schema = next(c["schema"] for c in CORPUS if c["name"] == "recipe")
    prompt = tok.encode("A recipe in JSON, please: " * 3).ids
    spec = _schema(schema)
    want = _toks(_run(agg, [_req("r", prompt, spec, temperature=0)])["r"])
    assert len(want) > 20
    # prefill -> decode: the first token crosses with the prompt's KV
    (first,) = _run(pre, [_req("r", prompt, spec, temperature=0, prefill_only=True)])["r"]
    assert first.prefilled and first.token_ids == want[:1]
    pull, imp = imported(first, pre, dec)  # the decode engine pulls the prefill's KV
    rest = _run(dec, [_req("r", prompt, spec, temperature=0, imported=imp)])["r"]
    assert pull.loaded and pre.release_pinned("r")
    assert first.token_ids + _toks(rest) == want
    jsonschema.validate(json.loads(first.text + _text(rest)), schema)
    # a re-prefill keeps the token already streamed (the matcher accepts it)
    (again,) = _run(pre, [_req("r2", prompt, spec, temperature=0, prefill_only=True,
                               forced_first_token=want[0])])["r2"]  # fmt: skip
    assert again.token_ids == want[:1]
    assert pre.release_pinned("r2")
    # migration: the matcher replays what the client has, then goes on alike
    for k in (1, 5, len(want) - 2):
        resumed = ResumedOutput(want[:k], len(tok.decode(want[:k])))
        got = _run(dec, [_req(f"m{k}", prompt, spec, temperature=0, resumed=resumed)])[f"m{k}"]
        assert want[:k] + _toks(got) == want, k
        assert got[-1].finish_reason == "stop"
    assert all(e.stats().blocks_used == 0 for e in (agg, pre, dec))


def test_a_resumed_output_the_grammar_rejects_is_refused(engine: Engine) -> None:
    spec = StructuredOutput(choice=["abc"])
    resumed = ResumedOutput([95, 95], 2)  # "{{" is no prefix of "abc"
    (out,) = _run(engine, [_req("m", [1, 5], spec, resumed=resumed)])["m"]
    assert out.finish_reason == "error" and out.error_code == "invalid_structured_output"
    assert "does not follow" in out.error


def test_min_tokens_does_not_hold_a_constrained_output_past_its_grammar(engine: Engine) -> None:
    spec = StructuredOutput(choice=["ok"])
    for temp in (0.0, 1.0):
        outs = _run(engine, [_req("r", [1, 5, 6], spec, min_tokens=20, temperature=temp)])["r"]
        assert _text(outs) == "ok" and outs[-1].finish_reason == "stop"


def test_unconstrained_rows_are_untouched(engine: Engine) -> None:
    """Free requests batched with constrained ones give the tokens they give alone."""
    free = [EngineRequest(f"f{i}", [1, 20 + i, 30], Sampling(max_tokens=12, temperature=0,
                                                             ignore_eos=True))
            for i in range(3)]  # fmt: skip
    alone = _run(engine, [EngineRequest(r.request_id, r.prompt_token_ids, r.params)
                          for r in free])  # fmt: skip
    spec = StructuredOutput(regex="[0-9]{10}")
    mixed = _run(engine, free + [_req(f"c{i}", [1, 40 + i], spec) for i in range(3)])
    for r in free:
        assert _toks(mixed[r.request_id]) == _toks(alone[r.request_id])


def test_grammar_cache_is_bounded_by_entries_and_bytes(engine: Engine) -> None:
    compiler = engine.structured.compiler
    grammars = {f"k{i}": compiler.compile(StructuredOutput(regex=f"a{{{i + 1}}}"))
                for i in range(4)}  # fmt: skip
    size = max(g.memory_size_bytes for g in grammars.values())
    cache = GrammarCache(max_bytes=10 * size, max_entries=3)
    for k, g in grammars.items():
        cache.put(k, g)
    assert len(cache) == 3 and cache.get("k0") is None  # least recently used out
    assert cache.get("k1") is grammars["k1"]
    cache.put("err", "why it failed")
    assert cache.get("k2") is None and cache.get("k1") is not None  # k1 was used: kept
    small = GrammarCache(max_bytes=size + 1, max_entries=100)
    for k, g in grammars.items():
        small.put(k, g)
    assert len(small) == 1 and small.bytes <= size + 1


SURROGATE = b"\xed\xb5\x96"  # U+DD56 in UTF-8's form: not valid UTF-8


@pytest.mark.parametrize("bound", [{"maxLength": 5}, {}])
def test_json_strings_take_only_valid_characters(engine: Engine, bound: dict) -> None:
    """xgrammar 0.2.8 lets a tab into a string with maxLength, and a UTF-16 surrogate into
    any string; the engine's grammars do not, and keep the keys' non-ASCII characters (the
    grammar's text reads back exactly). No special token (<unk>, ...) is allowed as text."""
    import xgrammar as xgr

    compiler = engine.structured.compiler
    schema = {"type": "object", "properties": {"größe": {"type": "string", **bound}},
              "required": ["größe"]}  # fmt: skip
    grammar = compiler.compile(_schema(schema))
    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string('{"größe":"a')
    assert not m.accept_string("\t") and not m.accept_string(SURROGATE)
    assert m.accept_string("ü京")
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    specials = list(engine.tokenizer.get_added_tokens_decoder())
    assert specials and all(not (int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in specials)
    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string('{"größe":"abc"}') and m.is_completed()
    stock = xgr.GrammarMatcher(compiler._compiler.compile_json_schema(json.dumps(schema)))
    assert stock.accept_string('{"größe": "a') and stock.accept_string(SURROGATE)  # the bug
    if bound:
        assert stock.accept_string("\t")


def test_negated_classes_of_every_kind_leave_out_surrogates(engine: Engine) -> None:
    import xgrammar as xgr

    compiler = engine.structured.compiler
    for spec, head in [(StructuredOutput(regex="x[^y]+"), "x"),
                       (StructuredOutput(grammar='root ::= "x" [^y]+'), "x"),
                       (StructuredOutput(grammar='start: "x" /[^y]+/'), "x")]:  # fmt: skip
        m = xgr.GrammarMatcher(compiler.compile(spec))
        assert m.accept_string(head) and not m.accept_string(SURROGATE), spec
        assert m.accept_string("ü") and not m.accept_string("y")


def test_bitmask_paths_agree() -> None:
    """xgrammar's CPU kernel and the torch path (other devices) mask the same tokens."""
    g = torch.Generator().manual_seed(0)
    vocab = 75  # not a multiple of 32: the last word is partial
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 3), dtype=torch.int32, generator=g)
    with torch.inference_mode():  # as the model's logits are
        logits = torch.randn(5, vocab, generator=g)
    rows = [0, 2, 3]
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, rows)
    mask_with_torch(b, bitmask, rows)
    assert torch.equal(a, b)
    for r in range(5):
        bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        want = [logits[r, t].item() if r not in rows or bits[t] else float("-inf")
                for t in range(vocab)]  # fmt: skip
        assert a[r].tolist() == want


def test_a_reasoning_models_grammar_waits_for_the_end_of_thinking(
    engine: Engine, tok: Tokenizer
) -> None:
    """``after`` (a reasoning parser's request): the model thinks unconstrained, its own
    greedy tokens, until the end of thinking (here forced by a thinking budget), then the
    grammar applies; a run resumed past the end goes on in the grammar."""
    from kvbm.protocol import ThinkingBudget
    from workers.engine_api import ResumedOutput

    end = tok.encode("</think>", add_special_tokens=False).ids
    start = tok.encode("<think>", add_special_tokens=False).ids
    prompt = tok.encode("Answer:").ids + start
    budget = ThinkingBudget(budget=5, start=start, end=end, natural_end=end)
    spec = StructuredOutput(regex="v[0-9]{2}", after=end)
    unconstrained = EngineRequest("f", prompt, Sampling(max_tokens=5, temperature=0.0))
    free = _toks(_run(engine, [unconstrained])["f"])
    outs = _run(engine, [_req("g", prompt, spec, temperature=0.0, thinking=budget)])["g"]
    toks = _toks(outs)
    assert toks[:5] == free and toks[5 : 5 + len(end)] == end
    assert outs[-1].finish_reason == "stop"
    assert re.fullmatch(r"v[0-9]{2}", tok.decode(toks[5 + len(end) :]))
    # the same key: a grammar compiled for one spec serves the other (after is not in it)
    assert spec.key() == StructuredOutput(regex="v[0-9]{2}").key()
    # resumed after the end and one grammar token: the matcher replays both
    resumed = ResumedOutput(output_token_ids=toks[: 6 + len(end)], emitted_chars=0)
    again = _run(engine, [_req("h", prompt, spec, temperature=0.0, thinking=budget,
                               resumed=resumed)])["h"]  # fmt: skip
    assert toks[: 6 + len(end)] + _toks(again) == toks


def test_thinking_then_grammar_across_prefill_decode_and_migration(make, tok) -> None:  # type: ignore[no-untyped-def]
    """A thinking budget and a grammar after the thinking give the aggregated run's tokens
    from a decode engine continuing a prefill engine's first token, and from streams
    resumed inside the thinking, inside the forced end and inside the answer."""
    from kvbm.protocol import ThinkingBudget

    agg, pre, dec = make(), make(), make()
    end = tok.encode("</think>", add_special_tokens=False).ids
    start = tok.encode("<think>", add_special_tokens=False).ids
    prompt = tok.encode("A short answer, please: ").ids + start
    kw = dict(temperature=0.0, thinking=ThinkingBudget(budget=4, start=start, end=end,
                                                       natural_end=end))  # fmt: skip
    spec = StructuredOutput(regex="[A-Z][a-z]{2,6}", after=end)
    want = _toks(_run(agg, [_req("r", prompt, spec, **kw)])["r"])
    assert want[4 : 4 + len(end)] == end
    assert re.fullmatch("[A-Z][a-z]{2,6}", tok.decode(want[4 + len(end) :]))
    (first,) = _run(pre, [_req("r", prompt, spec, prefill_only=True, **kw)])["r"]
    pull, imp = imported(first, pre, dec)
    rest = _run(dec, [_req("r", prompt, spec, imported=imp, **kw)])["r"]
    assert pull.loaded and pre.release_pinned("r")
    assert first.token_ids + _toks(rest) == want
    for k in (2, 4 + len(end) // 2, 5 + len(end)):
        resumed = ResumedOutput(want[:k], len(tok.decode(want[:k])))
        got = _run(dec, [_req(f"m{k}", prompt, spec, resumed=resumed, **kw)])[f"m{k}"]
        assert want[:k] + _toks(got) == want, k


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "opened"),
    [("hermes", 'Checking.<tool_call>\n{"name": "get_weather", "arguments": '),
     ("qwen3_coder", "Checking.<tool_call>\n<function=get_weather>\n"),
     ("llama3_json", '{"name": "get_weather", "parameters": ')],
)  # fmt: skip
def test_strict_auto_tool_calls(engine: Engine, tok: Tokenizer, parser: str, opened: str) -> None:
    """``auto`` with a strict tool (api.tools.strict_calls): free text stays the model's own
    greedy text; a call the model opens in its format is finished to the tool's schema
    and reads back through the format's parser."""
    from api.protocol import ChatCompletionRequest
    from api.tool_parsers import PARSERS, CallArgs, CallStart
    from api.tools import tool_plan
    from workers.engine_api import ResumedOutput

    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                               "parameters": WEATHER}},
             {"type": "function", "function": {"name": "note"}}]  # fmt: skip
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],  # type: ignore[list-item]
                                tools=tools)  # fmt: skip
    plan = tool_plan(req, parser)
    assert plan is not None
    spec = plan.constraint
    assert spec is not None and spec.best_effort and spec.structural_tag
    prompt = tok.encode("Weather in Oslo?").ids
    plain = EngineRequest("f", prompt, Sampling(max_tokens=24, temperature=0.0))
    free = _toks(_run(engine, [plain])["f"])
    text = tok.decode(free)
    assert "<tool_call>" not in text and '{"name"' not in text
    strict = _req("s", prompt, spec, max_tokens=24, temperature=0.0)
    assert _toks(_run(engine, [strict])["s"]) == free
    # a call opened (as a migrated stream's output so far): the rest follows the schema
    head = tok.encode(opened, add_special_tokens=False).ids
    resumed = ResumedOutput(head, len(opened))
    outs = _run(engine, [_req("c", prompt, spec, max_tokens=200, temperature=0.0,
                              resumed=resumed)])["c"]  # fmt: skip
    whole = opened + _text(outs)
    p = PARSERS[parser]()
    p.schemas = plan.schemas
    events = p.feed(whole) + p.finish()
    names = [e.name for e in events if isinstance(e, CallStart)]
    args = "".join(e.text for e in events if isinstance(e, CallArgs))
    assert names == ["get_weather"], whole
    jsonschema.validate(json.loads(args), WEATHER)


def test_a_best_effort_constraint_that_does_not_compile_runs_unconstrained(
    engine: Engine, tok: Tokenizer
) -> None:
    """Strict auto tool calls are best-effort: a schema xgrammar cannot compile leaves the
    request unconstrained (its model's own greedy text), where any other constraint ends
    it with invalid_structured_output."""
    bad = {"$ref": "#/$defs/missing"}
    prompt = tok.encode("Answer:").ids
    best = _schema(bad, best_effort=True)
    outs = _run(engine, [_req("b", prompt, best, max_tokens=6, temperature=1.0)])["b"]
    assert outs[-1].finish_reason == "length" and len(_toks(outs)) == 6
    greedy = _run(engine, [_req("g", prompt, best, max_tokens=6, temperature=0.0)])["g"]
    plain = EngineRequest("h", prompt, Sampling(max_tokens=6, temperature=0.0))
    assert _toks(greedy) == _toks(_run(engine, [plain])["h"])
    (refused,) = _run(engine, [_req("r", prompt, _schema(bad), max_tokens=6)])["r"]
    assert refused.finish_reason == "error" and refused.error_code == "invalid_structured_output"
