"""LoRA adapters in the reference engine: what a batch pays for them.

    python bench/lora_cost.py                         # the default tiny model
    python bench/lora_cost.py --batch 16 --prompt-len 128 --output-len 64 --rounds 3

One engine (``workers.engine.Engine``, in this process; no pipeline), a batch of
``--batch`` greedy requests of fresh random ``--prompt-len``-token prompts, each to
``--output-len`` tokens, run to the end, in four settings: the base model alone; every
request through one adapter; through 4 adapters, round robin; through ``--batch``
adapters, one each. The adapters (rank ``--rank``, on the seven projections) are written
by PEFT (``tests/lora_util.py``) and loaded before the timed run. Per setting: the
prefill's wall time (the steps until every request has its first token) and the decode
rate (output tokens per second after that), the median of ``--rounds`` rounds (settings
alternate order round to round), and each against the base model's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from cluster.lora import LoraRef  # noqa: E402
from kvbm.protocol import Sampling  # noqa: E402
from tasks.settings import DEFAULT_MODEL_DIR, engine_config  # noqa: E402
from tests.lora_util import ALL_PROJECTIONS, write_adapter  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.engine_api import EngineRequest  # noqa: E402
from workers.model_init import init_model, is_model_dir  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], loras: list[LoraRef | None],
        out_len: int, tag: str) -> tuple[float, float]:  # fmt: skip
    """(prefill seconds, decode tokens per second) of one batch."""
    params = Sampling(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        assert engine.add_request(EngineRequest(f"{tag}-{i}", p, params, lora=lora)) is None
    t0 = time.perf_counter()
    first: set[str] = set()
    tokens = 0
    t1 = None
    while engine.has_unfinished:
        for o in engine.step():
            if t1 is not None:
                tokens += len(o.token_ids)
            first.add(o.request_id)
        if t1 is None and len(first) == len(prompts):
            t1 = time.perf_counter()
    end = time.perf_counter()
    assert t1 is not None
    return t1 - t0, tokens / (end - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not is_model_dir(a.model):
        init_model(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    n_adapters = max(4, a.batch)
    # a LLaVA's text model only (tests/lora_util.py's pattern); a Llama's seven projections
    vision = "vision_config" in json.loads((a.model / "config.json").read_text())
    targets = None if vision else ALL_PROJECTIONS
    refs = [LoraRef(name=f"a{i}", path=str(write_adapter(a.model, tmp / f"a{i}", seed=i,
                                                         r=a.rank, alpha=2 * a.rank,
                                                         targets=targets)))
            for i in range(n_adapters)]  # fmt: skip
    settings = {
        "base model": [None] * a.batch,
        "1 adapter": [refs[0]] * a.batch,
        "4 adapters": [refs[i % 4] for i in range(a.batch)],
        f"{a.batch} adapters": [refs[i] for i in range(a.batch)],
    }
    config = engine_config(num_kv_blocks=4096, max_num_seqs=a.batch,
                           max_num_batched_tokens=max(2048, a.batch * a.prompt_len),
                           max_loras=n_adapters, max_lora_rank=a.rank)  # fmt: skip
    engine = Engine.from_model_dir(a.model, config)
    rng = random.Random(0)
    vocab = engine.model.cfg.vocab_size

    def prompts() -> list[list[int]]:
        return [[1] + [rng.randrange(5, vocab) for _ in range(a.prompt_len - 1)]
                for _ in range(a.batch)]  # fmt: skip

    for ref in refs:  # loaded before any timing
        engine.loras.get(ref)
    run(engine, prompts(), settings["4 adapters"], 4, "warm")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    names = list(settings)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run(engine, prompts(), settings[name], a.output_len,
                                     f"{r}-{name}"))  # fmt: skip
    base_pre = statistics.median(p for p, _ in results["base model"])
    base_dec = statistics.median(d for _, d in results["base model"])
    print(f"\nLoRA cost, reference engine, {a.model.name}: batch {a.batch}, prompts "
          f"{a.prompt_len}, {a.output_len} output tokens, rank {a.rank}, {a.threads} "
          f"thread(s), median of {a.rounds}\n")  # fmt: skip
    print("| setting | prefill ms | vs base | decode tok/s | vs base |")
    print("| --- | --- | --- | --- | --- |")
    for name, rs in results.items():
        pre = statistics.median(p for p, _ in rs)
        dec = statistics.median(d for _, d in rs)
        print(f"| {name} | {pre * 1000:.1f} | {pre / base_pre:.2f}x | {dec:.0f} | "
              f"{dec / base_dec:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
