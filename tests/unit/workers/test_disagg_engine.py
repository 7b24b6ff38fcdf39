"""Disaggregation at the engine level: prefill on one engine, then decode on another whose
request imports the prefill (``ImportedPrefill`` with a :class:`KVSource`, as a decode
worker's pull does): it waits in the loading state for blocks, its source copies the
prefill engine's pinned blocks into them, and it decodes from there. Tokens, text and
logprobs must equal one engine doing both (greedy, seeded sampling, stop strings), every
block comes back, and an import aborted mid-pull, one whose pull fails and one that finds
no room all end with their blocks freed."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from kvbm.protocol import Sampling
from tasks.settings import engine_config
from tests.unit.workers.test_resume_engine import _run as _run_outputs
from workers.engine import Engine
from workers.engine_api import EngineRequest, ImportedPrefill, RequestOutput

CFG = dict(block_size=16, num_kv_blocks=256, max_num_batched_tokens=128, max_model_len=512)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine, Engine]:
    make = lambda: Engine.from_model_dir(tiny_model_dir, engine_config(**CFG))  # noqa: E731
    return make(), make(), make()  # aggregated, prefill, decode


def _run_all(engine: Engine, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], str]]:
    for r in reqs:
        assert engine.add_request(r) is None
    out: dict[str, tuple[list[int], str]] = {r.request_id: ([], "") for r in reqs}
    while engine.has_unfinished:
        for o in engine.step():
            toks, text = out[o.request_id]
            out[o.request_id] = (toks + o.token_ids, text + o.text)
    return out


class Pull:
    """A decode engine's :class:`workers.engine_api.KVSource`: the prefill engine's pinned
    blocks, copied into the blocks the decode engine allocated (what a transfer backend
    does between worker processes, on the decode engine's loader thread). ``gate``: the
    copy waits for it; ``error``: the copy raises it."""

    def __init__(self, prefill: Engine, decode: Engine, rid: str, blocks: list[int],
                 timeout_s: float = 30.0) -> None:  # fmt: skip
        self.prefill, self.decode, self.rid, self.blocks = prefill, decode, rid, blocks
        self.deadline = time.monotonic() + timeout_s
        self.gate: threading.Event | None = None
        self.error: Exception | None = None
        self.loaded = False
        self.why: str | None = None

    def load(self, block_ids: list[int]) -> None:
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        assert len(block_ids) == len(self.blocks)
        src, dst = torch.tensor(self.blocks), torch.tensor(block_ids)
        self.decode.kv.data[dst] = self.prefill.kv.data[src]
        self.loaded = True

    def failed(self, why: str) -> None:
        self.why = why


def imported(o: RequestOutput, prefill: Engine, decode: Engine) -> tuple[Pull, ImportedPrefill]:
    """The decode side's import of prefill output ``o``: its source, and its first token."""
    assert o.prefilled and o.kv_block_ids
    pull = Pull(prefill, decode, o.request_id, o.kv_block_ids)
    return pull, ImportedPrefill(o.token_ids[0], len(o.text), pull, o.num_cached_tokens)


def _disagg(prefill: Engine, decode: Engine, reqs: list[EngineRequest],
            outputs: dict[str, list[RequestOutput]] | None = None) -> dict:  # fmt: skip
    """Both engines step in turn; each prefilled request joins the decode engine at once,
    importing the prefill's KV through a :class:`Pull`, whose pinned blocks the prefill
    engine releases once it has copied them, as a decode worker's release message says.
    ``outputs`` collects every output of each request, the prefill engine's first."""
    out: dict[str, tuple[list[int], str]] = {}
    seen = outputs if outputs is not None else {}
    for r in reqs:
        r.prefill_only = True
        prefill.add_request(r)
    by_id = {r.request_id: r for r in reqs}
    pulls: list[Pull] = []
    deadline = time.monotonic() + 120
    while prefill.has_unfinished or decode.has_unfinished or pulls:
        assert time.monotonic() < deadline, "the engines did not finish"
        for o in prefill.step():
            r = by_id[o.request_id]
            out[r.request_id] = (o.token_ids, o.text)
            seen.setdefault(o.request_id, []).append(o)
            if o.finished:  # ended on its first token: nothing to decode
                continue
            pull, imp = imported(o, prefill, decode)
            pulls.append(pull)
            assert decode.add_request(EngineRequest(r.request_id, r.prompt_token_ids,
                                                    r.params, imported=imp)) is None  # fmt: skip
        outs = decode.step()
        for o in outs:
            seen[o.request_id].append(o)
            toks, text = out[o.request_id]
            out[o.request_id] = (toks + o.token_ids, text + o.text)
        for pull in [p for p in pulls if p.loaded]:
            assert prefill.release_pinned(pull.rid)
            pulls.remove(pull)
        assert not any(p.why for p in pulls), [p.why for p in pulls]
        if not outs and decode.stalled:
            time.sleep(0.001)  # only pulls under way
    return out


def _requests(params: list[Sampling], seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 100, 200, 300]
    lengths += [rng.randrange(1, 400) for _ in range(len(params) - len(lengths))]
    return [
        EngineRequest(f"r{i}", [1] + [rng.randrange(5, 512) for _ in range(n - 1)], p)
        for i, (n, p) in enumerate(zip(lengths, params, strict=True))
    ]


def _clone(reqs: list[EngineRequest]) -> list[EngineRequest]:
    return [EngineRequest(r.request_id, list(r.prompt_token_ids), r.params) for r in reqs]


def test_disagg_equals_agg_greedy(engines: tuple[Engine, Engine, Engine]) -> None:
    agg, pre, dec = engines
    params = [Sampling(max_tokens=1 + i % 37, temperature=0, ignore_eos=True)
              for i in range(34)]  # fmt: skip
    reqs = _requests(params, 1)
    want = _run_all(agg, _clone(reqs))
    got = _disagg(pre, dec, _clone(reqs))
    assert got == want
    for e in engines:
        assert e.stats().blocks_used == 0
        assert not e.scheduler.pinned and not e.scheduler.loads


def test_disagg_equals_agg_seeded_stops_and_eos(engines: tuple[Engine, Engine, Engine]) -> None:
    agg, pre, dec = engines
    params = [
        Sampling(max_tokens=40, temperature=0.9, top_p=0.9, seed=i, stop=["ab", "9"])
        if i % 2 else Sampling(max_tokens=40, temperature=0, min_tokens=i % 5)
        for i in range(30)
    ]  # fmt: skip
    reqs = _requests(params, 2)
    want = _run_all(agg, _clone(reqs))
    got = _disagg(pre, dec, _clone(reqs))
    assert got == want
    assert any(len(t) < 40 for t, _ in want.values()), "some request should stop early"
    for e in engines:
        assert e.stats().blocks_used == 0


def test_disagg_logprobs_equal_agg(engines: tuple[Engine, Engine, Engine]) -> None:
    """The prefill engine's first output carries the first token's logprobs and the
    prompt's; the decode engine carries on with the next tokens' and never sends the
    prompt's again: together they are the aggregated run's."""
    agg, pre, dec = engines
    params = [Sampling(max_tokens=6, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                       logprobs=i % 4, prompt_logprobs=3 if i % 3 == 0 else None)
              for i in range(14)]  # fmt: skip
    reqs = _requests(params, 3)
    want = _run_outputs(agg, _clone(reqs))
    got: dict[str, list[RequestOutput]] = {}
    _disagg(pre, dec, _clone(reqs), got)
    for r in reqs:
        mine, ref = got[r.request_id], want[r.request_id]
        assert [t for o in mine for t in o.token_ids] == [t for o in ref for t in o.token_ids]
        lps = [lp for o in mine for lp in o.logprobs or []]
        ref_lps = [lp for o in ref for lp in o.logprobs or []]
        assert len(lps) == len(ref_lps) == 6
        assert _close(lps, ref_lps), r.request_id
        assert mine[0].prefilled or mine[0].finished
        assert _close(mine[0].prompt_logprobs, ref[0].prompt_logprobs), r.request_id
        assert (mine[0].prompt_logprobs is None) == (r.params.prompt_logprobs is None)
        assert all(o.prompt_logprobs is None for o in mine[1:])


def _close(a: object, b: object, tol: float = 1e-4) -> bool:
    """Logprob structures equal: the same ids and ranks, values within ``tol`` (the two
    runs batch their steps differently)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < tol
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


def test_forced_first_token_replays_what_was_streamed(
    engines: tuple[Engine, Engine, Engine],
) -> None:
    """A re-prefill keeps the first token the client already saw, even if sampling would
    now draw another (unseeded)."""
    _, pre, _ = engines
    p = Sampling(max_tokens=5, temperature=1.0)
    pre.add_request(EngineRequest("f", [1, 300, 301], p, prefill_only=True, forced_first_token=42))
    outs = []
    while pre.has_unfinished:
        outs += pre.step()
    assert outs[0].token_ids == [42] and outs[0].prefilled
    assert pre.release_pinned("f") and pre.stats().blocks_used == 0


def test_pinned_blocks_expire_when_never_pulled(tiny_model_dir: Path) -> None:
    e = Engine.from_model_dir(tiny_model_dir, engine_config(**CFG, kv_pin_timeout_s=5.0))
    e.add_request(EngineRequest("p", [1] + [300] * 40, Sampling(max_tokens=9, temperature=0),
                                prefill_only=True))  # fmt: skip
    while e.has_unfinished:
        e.step()
    assert e.stats().blocks_used == 3 and "p" in e.scheduler.pinned
    assert e.expire_pinned(now=0.0) == []  # not yet
    assert e.expire_pinned(now=e.scheduler.pinned["p"] + 0.01) == ["p"]
    assert e.stats().blocks_used == 0 and e.stats().pins_expired == 1


def _prefilled(tiny_model_dir: Path, n: int = 40) -> tuple[Engine, Engine, RequestOutput]:
    """A prefill engine holding one prefilled request ``d`` (``n`` prompt tokens), and a
    decode engine to import it into."""
    pre, dec = (Engine.from_model_dir(tiny_model_dir, engine_config(**CFG)) for _ in range(2))
    pre.add_request(EngineRequest("d", [1] + [300] * (n - 1), Sampling(max_tokens=4),
                                  prefill_only=True))  # fmt: skip
    (o,) = pre.step()
    assert o.prefilled and len(o.kv_block_ids or []) == 3
    return pre, dec, o


def _step_until(engine: Engine, done, timeout: float = 10.0) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
    """Step ``engine`` until ``done(outputs so far)``; the outputs."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout
    while not done(outs):
        assert time.monotonic() < deadline, "the engine did not get there"
        outs += engine.step()
        time.sleep(0.001)
    return outs


def test_abort_during_pull_frees_only_after_the_pull(tiny_model_dir: Path) -> None:
    pre, e, o = _prefilled(tiny_model_dir)
    pull, imp = imported(o, pre, e)
    pull.gate = threading.Event()
    assert e.add_request(EngineRequest("d", [1] + [300] * 39, Sampling(max_tokens=4),
                                       imported=imp)) is None  # fmt: skip
    assert e.step() == [] and "d" in e.scheduler.loads and e.stats().blocks_used == 3
    assert e.abort("d") is None  # the transfer may still be writing into the 3 blocks: keep them
    assert e.step() == [] and e.stats().blocks_used == 3 and e.stats().loading == 1
    pull.gate.set()
    outs = _step_until(e, lambda outs: outs)
    assert [(x.request_id, x.finished, x.finish_reason) for x in outs] == [("d", True, "abort")]
    assert e.stats().blocks_used == 0 and not e.scheduler.loads and not e.has_unfinished
    assert pull.why is None  # an abort is no failed pull: the decode task is not retried


def test_a_failed_pull_frees_the_blocks_and_says_why(tiny_model_dir: Path) -> None:
    pre, e, o = _prefilled(tiny_model_dir)
    pull, imp = imported(o, pre, e)
    pull.error = OSError("prefill worker gone")
    assert e.add_request(EngineRequest("d", [1] + [300] * 39, Sampling(max_tokens=4),
                                       imported=imp)) is None  # fmt: skip
    _step_until(e, lambda _: pull.why is not None)
    assert pull.why == "prefill worker gone"  # the decode task prefills again elsewhere
    assert e.stats().blocks_used == 0 and not e.scheduler.loads and not e.has_unfinished
    assert pre.release_pinned("d") and pre.stats().blocks_used == 0


def test_an_import_aborted_while_waiting_for_blocks_ends_at_once(tiny_model_dir: Path) -> None:
    pre, e, o = _prefilled(tiny_model_dir)
    hog = e.scheduler.kv.allocate_slots("hog", CFG["num_kv_blocks"] * 16)  # every block
    assert hog is not None
    pull, imp = imported(o, pre, e)
    assert e.add_request(EngineRequest("d", [1] + [300] * 39, Sampling(max_tokens=4),
                                       imported=imp)) is None  # fmt: skip
    assert e.step() == [] and "d" not in e.scheduler.loads and e.has_unfinished
    out = e.abort("d")
    assert out is not None and out.finish_reason == "abort" and not e.has_unfinished
    assert pull.why is None and not pull.loaded
    e.scheduler.kv.free("hog")
    assert e.stats().blocks_used == 0
