"""Decode attention on CPU: the C kernel that reads KV blocks in place against torch's gather.

    python bench/decode_attention.py                 # default model, both tables
    python bench/decode_attention.py --model DIR --seqs 1,4,16,64 --contexts 128,512,2048

Table 1, one attention layer of a decode-only step (``LlamaModel._attention``: projections,
KV write, attention, output projection) for D sequences of one context length, their blocks
scattered over the pool as a long-running worker's are: median microseconds per call on
each path, and the ratio. Table 2, the whole engine in this process on the serving bench's
stream (``bench/serve_latency.py``: 16 requests in flight, 128-token prompts, 64 +- 50%
output tokens, greedy): output tok/s and the median step, each path run ``--rounds`` times,
alternating, so the machine's drift falls on both. Both paths give the same greedy tokens
(``tests/unit/workers/test_engine_parity.py``); table 2 checks that the two produced the
same tokens here too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from serve_latency import make_prompts, output_lengths  # noqa: E402

from kvbm.protocol import Sampling  # noqa: E402
from tasks.settings import DEFAULT_MODEL_DIR, engine_config  # noqa: E402
from workers import paged_kernel  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.engine_api import EngineRequest  # noqa: E402
from workers.llama import AttentionMetadata  # noqa: E402

PATHS = ("torch", "kernel")
KERNEL_DIR = Path(engine_config().kernel_dir)  # where the engines below find it


def layer_times(engine: Engine, seqs: int, ctx: int, iters: int, seed: int) -> dict[str, float]:
    """Median us of one decode layer on each path, same cache, same blocks."""
    model, cfg, bs = engine.model, engine.model.cfg, engine.config.block_size
    nb = -(-ctx // bs)
    rng = random.Random(seed)
    blocks = rng.sample(range(engine.config.num_kv_blocks), seqs * nb)
    decodes = [(i, ctx, blocks[i * nb : (i + 1) * nb]) for i in range(seqs)]
    slots = torch.tensor([t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for _, _, t in decodes])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seqs, cfg.hidden_size, generator=g)
    cos, sin = model._rope(torch.full((seqs,), ctx - 1))
    kernel = paged_kernel.load(KERNEL_DIR)
    out = {}
    with torch.inference_mode():
        for name in PATHS:
            meta = AttentionMetadata.build(slots, [], decodes, bs, cfg.num_layers,
                                           kernel=kernel if name == "kernel" else None)  # fmt: skip
            times = []
            for i in range(iters + 5):
                t = time.perf_counter()
                model._attention(x, "model.layers.0.", 0, cos, sin, meta, engine.kv)
                if i >= 5:
                    times.append(time.perf_counter() - t)
            out[name] = statistics.median(times) * 1e6
    return out


def engine_run(engine: Engine, steps: int, seed: int) -> tuple[float, float, list[list[int]]]:
    """tok/s and median step (ms) over ``steps`` steps of the serving bench's stream."""
    # Every request makes at least 32 tokens, one per step, 16 at a time: steps / 2 + 16
    # requests at most, all distinct (as on the serving bench: no prefix-cache hits).
    n = steps + 16
    prompts = make_prompts(n, 128, engine.model.cfg.vocab_size, seed)
    lengths = output_lengths(n, 64, 0.5, seed)
    tokens: dict[str, list[int]] = {}

    def submit() -> None:
        i = len(tokens)
        tokens[str(i)] = []
        params = Sampling(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
        engine.add_request(EngineRequest(str(i), prompts[i], params))

    for _ in range(16):
        submit()
    made, step_s = 0, []
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - t)
        for o in outs:
            tokens[o.request_id] += o.token_ids
            made += len(o.token_ids)
            if o.finished:
                submit()
    wall = time.perf_counter() - start
    for rid in list(tokens):  # leave the engine empty for the next run
        engine.abort(rid)
    return made / wall, statistics.median(step_s) * 1e3, list(tokens.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--seqs", default="1,4,16,64", help="decode batch sizes (table 1)")
    ap.add_argument("--contexts", default="128,512,2048", help="context lengths (table 1)")
    ap.add_argument("--iters", type=int, default=100, help="calls per cell (table 1)")
    ap.add_argument("--steps", type=int, default=800, help="engine steps per run (table 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        paged_kernel.load(KERNEL_DIR)
    except paged_kernel.KernelUnavailable as e:
        print(f"the kernel cannot be built here: {e}", file=sys.stderr)
        return 1
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = max(2048, 64 * -(-max(contexts) // 16) + 64)
    engines = {
        name: Engine.from_model_dir(
            args.model, engine_config(decode_attention=name, num_kv_blocks=blocks)
        )
        for name in PATHS
    }
    print(f"model {args.model.name}, torch threads {args.threads}\n")
    print("one decode layer (us, median)")
    print(f"{'seqs':>5} {'context':>8} {'torch':>9} {'kernel':>9} {'speedup':>8}")
    for ctx in contexts:
        for d in (int(s) for s in args.seqs.split(",")):
            t = layer_times(engines["kernel"], d, ctx, args.iters, seed=d * 7919 + ctx)
            print(f"{d:>5} {ctx:>8} {t['torch']:>9.1f} {t['kernel']:>9.1f} "
                  f"{t['torch'] / t['kernel']:>7.2f}x")  # fmt: skip

    print(f"\nengine in-process, 16 in flight, prompt 128, output 64 +- 50%, {args.steps} steps")
    print(f"{'round':>5} {'path':>7} {'tok/s':>8} {'step p50 ms':>12}")
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in PATHS}
    same = True
    for r in range(args.rounds):
        outs = {}
        for name in PATHS if r % 2 == 0 else PATHS[::-1]:
            tps, step_ms, outs[name] = engine_run(engines[name], args.steps, seed=r)
            res[name].append((tps, step_ms))
            print(f"{r:>5} {name:>7} {tps:>8.0f} {step_ms:>12.3f}")
        # the scheduler only counts tokens, so both runs admit and cut the same requests
        same &= outs["torch"] == outs["kernel"]
    tt = statistics.median(t for t, _ in res["torch"])
    tk = statistics.median(t for t, _ in res["kernel"])
    print(f"median tok/s: torch {tt:.0f}, kernel {tk:.0f} ({tk / tt:.2f}x); "
          f"same greedy tokens on both paths: {'yes' if same else 'NO'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
