"""Embeddings on the reference engine: what they cost, and what they cost the streams that
decode beside them.

    python bench/embeddings.py
    python bench/embeddings.py --model DIR --lengths 16,128,2048 --chunks 2048,256
    python bench/embeddings.py --serve       # and table 3, through `conveyor serve`

Both tables run the engine in this process the way a worker's engine process does: an
``EngineLoop`` thread stepping the engine, and the ``EmbeddingRunner`` computing each
embedding a chunk at a time on that thread, between two steps (workers/pooling.py).

Table 1, throughput: ``--inputs`` inputs of each length embedded one after another, in
chunks of ``--chunk`` tokens (a worker's: ``workers.pooling.CHUNK_TOKENS``): inputs/s and
prompt tokens/s.
Table 1b, the chunk size: one 2048-token input run chunk by chunk on this thread, for each
``--sweep`` size (the sizes alternate within a round): its total time and its longest
chunk.
Table 2, the decode pace beside them: 16 greedy streams (128-token prompts) decode while
``--long`` inputs of 2048 tokens are embedded next to them, one after another; the gap
between two of the streams' steps (p50, p99, max, in ms), with no embeddings, and with
embeddings computed in chunks of each ``--chunks`` size. A chunk runs between two steps,
so the longest gap is about one step plus one chunk's forward.
Table 3 (``--serve``), the whole pipeline: ``conveyor serve --workers 1`` on the same model,
``/v1/embeddings`` over HTTP (base64): the latency of one 16-token input (p50 of 20 in a
row), and inputs/s for one request of ``--inputs`` x 4 such inputs (each input its own
``embed`` task, 16 in flight).
Every cell is the median of ``--rounds`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from common import conveyor_serve  # noqa: E402
from serve_latency import make_prompts  # noqa: E402

from kvbm.protocol import Pooling, Sampling  # noqa: E402
from tasks.settings import DEFAULT_MODEL_DIR, engine_config  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.engine_api import EngineRequest, RequestOutput  # noqa: E402
from workers.engine_loop import EngineLoop  # noqa: E402
from workers.pooling import CHUNK_TOKENS, EmbeddingRunner  # noqa: E402

STREAMS = 16


class Sink:
    """What the loop and the runner publish: the time of every step that carried stream
    tokens, and the embeddings finished."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.embedded = 0
        self.cv = threading.Condition()

    def __call__(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        with self.cv:
            if any(o.token_ids for o in outs):
                self.step_times.append(now)
            self.embedded += sum(1 for o in outs if o.embedding is not None)
            self.cv.notify_all()

    def wait_embedded(self, n: int) -> None:
        with self.cv:
            while self.embedded < n:
                self.cv.wait(60)


def throughput(engine: Engine, length: int, inputs: int, chunk: int,
               seed: int) -> tuple[float, float]:  # fmt: skip
    """(inputs/s, tokens/s) embedding ``inputs`` inputs of ``length`` tokens in a row."""
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    runner = EmbeddingRunner(engine, loop, sink, chunk)
    prompts = make_prompts(inputs, length, engine.model.cfg.vocab_size, seed)
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            runner.submit(f"e{i}", p, Pooling())
        sink.wait_embedded(inputs)
        wall = time.perf_counter() - t0
    finally:
        runner.close()
        loop.stop()
    return inputs / wall, inputs * length / wall


def chunk_sweep(engine: Engine, sizes: list[int], rounds: int) -> dict[int, list[tuple]]:
    """Per chunk size, per round: (total s, longest chunk ms) of one 2048-token input."""
    ids = make_prompts(1, 2048, engine.model.cfg.vocab_size, 7)[0]
    out: dict[int, list[tuple]] = {c: [] for c in sizes}
    for r in range(rounds):
        for c in sizes if r % 2 == 0 else sizes[::-1]:
            job = engine.pooler().start(ids, Pooling())
            times = []
            while not job.done:
                t = time.perf_counter()
                job.step(c)
                times.append(time.perf_counter() - t)
            out[c].append((sum(times), max(times) * 1e3))
    return out


def decode_gaps(engine: Engine, long: int, chunk: int | None, seed: int) -> list[float]:
    """Gaps (ms) between the streams' steps while ``long`` 2048-token inputs are embedded
    in chunks of ``chunk`` tokens (None: no embeddings, as many steps as the run with)."""
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    runner = EmbeddingRunner(engine, loop, sink, chunk or 1)
    vocab = engine.model.cfg.vocab_size
    prompts = make_prompts(STREAMS, 128, vocab, seed)
    try:
        for i, p in enumerate(prompts):
            params = Sampling(temperature=0.0, max_tokens=1800, ignore_eos=True)
            loop.submit(EngineRequest(f"s{i}", p, params))
        while len(sink.step_times) < 20:  # every stream past its prefill
            time.sleep(0.01)
        start = len(sink.step_times)
        if chunk is None:
            time.sleep(0.2 + 0.15 * long)  # about as long as the runs with embeddings
        else:
            for i, p in enumerate(make_prompts(long, 2048, vocab, seed + 1)):
                runner.submit(f"e{i}", p, Pooling())
            sink.wait_embedded(long)
        with sink.cv:
            times = sink.step_times[start:]
    finally:
        for i in range(STREAMS):
            loop.abort(f"s{i}")
        loop.call(lambda _e: None).result()  # the aborts are in: the engine is empty again
        runner.close()
        loop.stop()
    return [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]


def serve(model: Path, inputs: int, rounds: int) -> None:
    """Table 3: one input's latency and a batch's inputs/s through the pipeline."""
    env = {"CONVEYOR_MODEL": str(model)}
    log = Path("/tmp") / f"bench-embeddings-{time.time_ns()}.log"
    with conveyor_serve(["--workers", "1"], log, {"generate": 1}, env) as (url, _):
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        one, rates = [], []
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as http:

            def post(batch: list[list[int]]) -> float:
                t0 = time.perf_counter()
                r = http.post("/v1/embeddings", json={"model": name, "input": batch,
                                                      "encoding_format": "base64"})  # fmt: skip
                assert r.status_code == 200 and len(r.json()["data"]) == len(batch), r.text
                return time.perf_counter() - t0

            post(make_prompts(16, 16, 500, 99))  # warm-up
            for r in range(rounds):
                prompts = make_prompts(20 + inputs * 4, 16, 500, r)  # ids any model has
                one.append(statistics.median(post([p]) * 1e3 for p in prompts[:20]))
                rates.append(inputs * 4 / post(prompts[20:]))
    print(f"\nthrough `conveyor serve --workers 1`, 16-token inputs, median of {rounds}")
    print(f"one input: {statistics.median(one):.1f} ms; one request of {inputs * 4} inputs: "
          f"{statistics.median(rates):.0f} inputs/s")  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", default="16,128,2048", help="input lengths (table 1)")
    ap.add_argument("--inputs", type=int, default=32, help="inputs per length (table 1)")
    ap.add_argument("--chunk", type=int, default=CHUNK_TOKENS, help="chunk size (table 1)")
    ap.add_argument("--sweep", default="128,256,512,1024,2048", help="chunk sizes (table 1b)")
    ap.add_argument("--chunks", default="2048,256", help="chunk sizes (table 2)")
    ap.add_argument("--long", type=int, default=4, help="2048-token inputs (table 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default)")
    ap.add_argument("--serve", action="store_true", help="table 3: through conveyor serve")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_model_dir(args.model, engine_config(num_kv_blocks=2048))
    print(f"model {args.model.name}, torch threads {args.threads}, pooling "
          f"{engine.pooling.type}\n")  # fmt: skip
    print(f"embedding throughput, {args.inputs} inputs in a row, chunks of {args.chunk} "
          f"tokens, median of {args.rounds}")  # fmt: skip
    print(f"{'tokens':>7} {'inputs/s':>9} {'tokens/s':>9}")
    for length in (int(x) for x in args.lengths.split(",")):
        runs = [throughput(engine, length, args.inputs, args.chunk, seed=r)
                for r in range(args.rounds)]  # fmt: skip
        print(f"{length:>7} {statistics.median(r[0] for r in runs):>9.1f} "
              f"{statistics.median(r[1] for r in runs):>9.0f}")  # fmt: skip

    sizes = [int(c) for c in args.sweep.split(",")]
    print(f"\none 2048-token input by chunk size, median of {args.rounds}")
    print(f"{'chunk':>7} {'total s':>8} {'longest chunk ms':>17}")
    for c, runs in chunk_sweep(engine, sizes, args.rounds).items():
        print(f"{c:>7} {statistics.median(t for t, _ in runs):>8.3f} "
              f"{statistics.median(m for _, m in runs):>17.0f}")  # fmt: skip

    print(f"\n{STREAMS} streams decoding; {args.long} x 2048-token inputs embedded beside "
          f"them: gap between two steps (ms), median of {args.rounds}")  # fmt: skip
    print(f"{'embeddings':>18} {'p50':>7} {'p99':>7} {'max':>7} {'steps':>6}")
    cases: list[int | None] = [None, *(int(c) for c in args.chunks.split(","))]
    for chunk in cases:
        runs = [decode_gaps(engine, args.long, chunk, seed=r) for r in range(args.rounds)]
        name = "none" if chunk is None else f"chunks of {chunk}"
        cells = [statistics.median(pct(g, q) for g in runs) for q in (0.5, 0.99, 1.0)]
        steps = statistics.median(len(g) for g in runs)
        print(f"{name:>18} {cells[0]:>7.2f} {cells[1]:>7.2f} {cells[2]:>7.2f} {steps:>6.0f}")
    if args.serve:
        serve(args.model, args.inputs, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
