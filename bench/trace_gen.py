"""Mooncake-format request traces: read, write, scale, synthesize, turn into token ids.

    python bench/trace_gen.py --out trace.jsonl --sessions 128 --rate 16
    python bench/replay.py gen --out trace.jsonl ...            # the same generator

A trace is JSONL, one request a line: ``timestamp`` (ms since the trace began),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: hash id i stands for
block i of the prompt, ``tokens_per_hash_id`` tokens long (512 in Mooncake's traces; the
last block may be partial). Two requests whose hash ids agree up to block k share their
first k+1 blocks of prompt. Nothing here talks to a server: ``bench/replay.py`` does.

Prompt tokens: block content is a function of the hash id alone (a PRNG seeded with it,
never Python's ``hash()``), so equal leading hash ids give equal token prefixes in every
process. ``ideal_reusable`` counts what an infinite prefix cache could serve per request.

The synthetic trace is prefix-heavy on purpose: a few shared system prompts with skewed
popularity, multi-turn sessions whose turn k repeats all of turn k-1 (prompt, then its
output rounded up to whole blocks) before the new user blocks, Poisson arrivals.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MOONCAKE_TOKENS_PER_HASH_ID = 512
DEFAULT_TOKEN_RANGE = (32, 500)  # the tiny default model's vocab is 512; no special tokens
_BLOCK_SALT = 0x636F6E76  # keeps block content apart from other seeded streams


# --- Trace records --------------------------------------------------------------------
@dataclass(slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]

    def to_json(self) -> str:
        ts = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() else self.timestamp_ms
        return json.dumps({"timestamp": ts, "input_length": self.input_length,
                           "output_length": self.output_length,
                           "hash_ids": self.hash_ids})  # fmt: skip


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests in arrival order (a stable sort on timestamp); blank lines are skipped."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            req = TraceRequest(float(obj["timestamp"]), int(obj["input_length"]),
                               int(obj["output_length"]),
                               [int(h) for h in obj["hash_ids"]])  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: not a Mooncake request ({e!r})") from e
        if req.input_length < 1 or req.output_length < 0 or not req.hash_ids:
            raise ValueError(f"trace line {n}: needs input_length >= 1, output_length >= 0 "
                             "and at least one hash id")  # fmt: skip
        if min(req.hash_ids) < 0:
            raise ValueError(f"trace line {n}: hash ids must be >= 0")
        out.append(req)
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def read_trace(path: Path) -> list[TraceRequest]:
    with open(path) as f:
        return parse_trace(f)


def write_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(r.to_json() + "\n")


# --- Scaling --------------------------------------------------------------------------
def scaled_block_tokens(tokens_per_hash_id: int, scale_down: float) -> int:
    """Tokens one hash id stands for after ``--scale-down``."""
    if tokens_per_hash_id < 1 or scale_down <= 0:
        raise ValueError("tokens_per_hash_id must be >= 1 and scale_down > 0")
    return max(1, int(tokens_per_hash_id / scale_down))


def scale_trace(
    requests: list[TraceRequest],
    tokens_per_hash_id: int,
    scale_down: float = 1.0,
    output_scale_down: float | None = None,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
) -> list[TraceRequest]:
    """Lengths for a smaller machine: input / scale_down (never past the hash ids' blocks),
    output / output_scale_down (default scale_down), at least one token of each; then the
    optional caps. Hash ids and timestamps are kept."""
    block = scaled_block_tokens(tokens_per_hash_id, scale_down)
    out_div = scale_down if output_scale_down is None else output_scale_down
    if out_div <= 0:
        raise ValueError("output_scale_down must be > 0")
    out = []
    for i, r in enumerate(requests):
        if r.input_length > len(r.hash_ids) * tokens_per_hash_id:
            raise ValueError(f"request {i}: input_length {r.input_length} > {len(r.hash_ids)} "
                             f"hash ids x {tokens_per_hash_id} tokens; wrong "
                             "--tokens-per-hash-id?")  # fmt: skip
        n_in = min(max(1, math.ceil(r.input_length / scale_down)), len(r.hash_ids) * block)
        n_out = max(1, round(r.output_length / out_div))
        if max_input_tokens is not None:
            n_in = max(1, min(n_in, max_input_tokens))
        if max_output_tokens is not None:
            n_out = max(1, min(n_out, max_output_tokens))
        out.append(replace(r, input_length=n_in, output_length=n_out))
    return out


# --- Prompt tokens --------------------------------------------------------------------
def block_tokens(
    hash_id: int, n: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
) -> np.ndarray:
    """The first n tokens of hash id ``hash_id``'s block: ids in [lo, hi), the same in every
    process (numpy's PCG64 seeded with the id)."""
    lo, hi = token_range
    rng = np.random.default_rng((_BLOCK_SALT, hash_id))
    return rng.integers(lo, hi, size=n, dtype=np.int64)


def prompt_tokens(
    req: TraceRequest, block: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
) -> list[int]:
    """Token ids of the request's prompt: its hash ids' blocks, cut at ``input_length``."""
    parts = []
    left = req.input_length
    for h in req.hash_ids:
        if left <= 0:
            break
        parts.append(block_tokens(h, min(block, left), token_range))
        left -= block
    assert left <= 0, "input_length exceeds the hash ids' blocks: scale_trace checks this"
    return np.concatenate(parts).tolist()


# --- Ideal prefix reuse ---------------------------------------------------------------
def ideal_reusable(requests: list[TraceRequest], block: int, engine_block: int) -> list[int]:
    """Per request, in arrival order: prompt tokens an infinite prefix cache holds already.

    That is the longest token prefix shared with any earlier request: leading hash ids
    matched as a chain (block i only counts under the same blocks 0..i-1), a block counted
    for as many of its tokens as an earlier request had of it. Capped at input_length - 1
    (the engine computes the last token) and rounded down to ``engine_block``."""
    if block < 1 or engine_block < 1:
        raise ValueError("block and engine_block must be >= 1")
    child: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node; root is -1
    held: list[int] = []  # node -> the most tokens of its block any request had so far
    out = []
    for r in requests:
        parent, reused, matching = -1, 0, True
        for i, h in enumerate(r.hash_ids):
            n = min(block, r.input_length - i * block)
            if n <= 0:
                break
            node = child.get((parent, h))
            if matching:
                got = 0 if node is None else min(held[node], n)
                reused += got
                matching = got == n
            if node is None:
                node = child[(parent, h)] = len(held)
                held.append(n)
            else:
                held[node] = max(held[node], n)
            parent = node
        out.append(min(reused, r.input_length - 1) // engine_block * engine_block)
    return out


def trace_stats(requests: list[TraceRequest], ideal: list[int]) -> dict:
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3 if requests else 0.0
    prompt = sum(r.input_length for r in requests)
    return dict(requests=len(requests), span_s=span, prompt_tokens=prompt,
                output_tokens=sum(r.output_length for r in requests),
                ideal_reusable_tokens=sum(ideal),
                ideal_fraction=sum(ideal) / prompt if prompt else float("nan"),
                unique_hash_ids=len({h for r in requests for h in r.hash_ids}))  # fmt: skip


# --- Synthetic prefix-heavy trace -----------------------------------------------------
@dataclass(slots=True)
class SyntheticConfig:
    system_prompts: int = 4
    system_len: int = 4  # hash ids per system prompt
    system_skew: float = 1.0  # Zipf exponent of system prompt popularity
    sessions: int = 128
    turns: int = 6
    user_len: int = 2  # hash ids per user turn
    output_len: int = 256  # tokens per answer
    rate: float = 20.0  # requests/s, Poisson
    active_sessions: int = 64  # sessions interleaved at any time
    think_time_s: float = 2.0  # least time between two turns of one session
    seed: int = 0
    tokens_per_hash_id: int = MOONCAKE_TOKENS_PER_HASH_ID


def synthesize(cfg: SyntheticConfig) -> list[TraceRequest]:
    """Sessions open in order, up to ``active_sessions`` at a time; each arrival goes to a
    random open session whose user has thought for ``think_time_s`` since its last turn
    (a conversation's next turn follows the previous answer, as in real chat traces);
    a session closes after ``turns`` turns. Same config, same trace."""
    if min(cfg.system_prompts, cfg.system_len, cfg.sessions, cfg.turns, cfg.user_len,
           cfg.active_sessions, cfg.tokens_per_hash_id) < 1 or cfg.rate <= 0 \
            or cfg.think_time_s < 0:  # fmt: skip
        raise ValueError("synthetic knobs must be >= 1 (rate > 0, think time >= 0)")
    rng = random.Random(cfg.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [fresh(cfg.system_len) for _ in range(cfg.system_prompts)]
    weights = [1 / (i + 1) ** cfg.system_skew for i in range(cfg.system_prompts)]
    answer_blocks = math.ceil(cfg.output_len / cfg.tokens_per_hash_id)
    waiting = list(range(cfg.sessions))
    history: dict[int, list[int]] = {}  # open session -> hash ids its next turn starts with
    turns_done: dict[int, int] = {}
    ready_at: dict[int, float] = {}  # open session -> when its next turn may come
    out: list[TraceRequest] = []
    t = 0.0
    while waiting or history:
        while waiting and len(history) < cfg.active_sessions:
            s = waiting.pop(0)
            history[s] = list(rng.choices(systems, weights)[0])
            turns_done[s] = 0
            ready_at[s] = t
        ready = sorted(s for s in history if ready_at[s] <= t)
        if not ready:  # every open user is still thinking: the next arrival waits
            t = min(ready_at[s] for s in history) + rng.expovariate(cfg.rate)
            continue
        s = rng.choice(ready)
        ids = history[s] + fresh(cfg.user_len)
        out.append(TraceRequest(round(t * 1e3), len(ids) * cfg.tokens_per_hash_id,
                                cfg.output_len, ids))  # fmt: skip
        turns_done[s] += 1
        if turns_done[s] == cfg.turns:
            del history[s]
        else:
            history[s] = ids + fresh(answer_blocks)
            ready_at[s] = t + cfg.think_time_s
        t += rng.expovariate(cfg.rate)
    return out


def add_synthetic_args(ap: argparse.ArgumentParser) -> None:
    d = SyntheticConfig()
    g = ap.add_argument_group("synthetic trace")
    g.add_argument(
        "--system-prompts",
        type=int,
        default=d.system_prompts,
        help="shared system prompts (%(default)s)",
    )
    g.add_argument(
        "--system-len",
        type=int,
        default=d.system_len,
        help="hash ids per system prompt (%(default)s)",
    )
    g.add_argument(
        "--system-skew",
        type=float,
        default=d.system_skew,
        help="Zipf exponent of system prompt popularity (%(default)s)",
    )
    g.add_argument("--sessions", type=int, default=d.sessions, help="(%(default)s)")
    g.add_argument("--turns", type=int, default=d.turns, help="turns per session (%(default)s)")
    g.add_argument(
        "--user-len", type=int, default=d.user_len, help="hash ids per user turn (%(default)s)"
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=d.output_len,
        help="output tokens per turn, before --scale-down (%(default)s)",
    )
    g.add_argument(
        "--rate", type=float, default=d.rate, help="Poisson arrival rate, requests/s (%(default)s)"
    )
    g.add_argument(
        "--active-sessions",
        type=int,
        default=d.active_sessions,
        help="sessions interleaved at once (%(default)s)",
    )
    g.add_argument(
        "--think-time", type=float, default=d.think_time_s,
        help="least seconds between two turns of a session (%(default)s)",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=d.seed, help="(%(default)s)")  # fmt: skip


def synthetic_config(args: argparse.Namespace) -> SyntheticConfig:
    return SyntheticConfig(system_prompts=args.system_prompts, system_len=args.system_len,
                           system_skew=args.system_skew, sessions=args.sessions,
                           turns=args.turns, user_len=args.user_len,
                           output_len=args.output_len, rate=args.rate,
                           active_sessions=args.active_sessions,
                           think_time_s=args.think_time, seed=args.seed,
                           tokens_per_hash_id=args.tokens_per_hash_id)  # fmt: skip


def gen_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Write a synthetic prefix-heavy "
                                 "Mooncake-format trace.")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    ap.add_argument("--tokens-per-hash-id", type=int, default=MOONCAKE_TOKENS_PER_HASH_ID,
                    help="tokens per hash id (%(default)s)")  # fmt: skip
    ap.add_argument("--engine-block-size", type=int, default=16,
                    help="for the ideal-reuse figure printed (%(default)s)")  # fmt: skip
    add_synthetic_args(ap)
    args = ap.parse_args(argv)
    reqs = synthesize(synthetic_config(args))
    write_trace(reqs, args.out)
    st = trace_stats(reqs, ideal_reusable(reqs, args.tokens_per_hash_id, args.engine_block_size))
    print(f"{args.out}: {st['requests']} requests over {st['span_s']:.1f}s, "
          f"{st['prompt_tokens']} prompt tokens, {100 * st['ideal_fraction']:.1f}% reusable "
          "by an ideal prefix cache")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(gen_main())
