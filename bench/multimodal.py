"""Multimodal serving: the four modes side by side, an encode worker's batching, and the
embedding cache.

    python bench/multimodal.py                          # all three parts
    python bench/multimodal.py --parts modes --concurrency 1,4 --modes agg,e-pd

The model is ``--model DIR``, else the ``llava-1.5-like`` preset (336-px images, 576 image
tokens; ``conveyor model init --preset llava-1.5-like``), made once under
``~/.cache/conveyor/``. Every part starts its own ``conveyor serve`` (embedded Redis, one
worker per pool unless said otherwise, no Flower) and stops it at the end.

``modes``  For each mode (``agg``, ``e-pd``, ``e-p-d``, ``ep-d``) a fresh server; at each
           concurrency c, ``--requests`` x c chat requests (at least 8), each with its own
           336-px image (nothing cached anywhere) and a short question, streamed, c in
           flight at a time; ``--output-len`` tokens each (``ignore_eos``). TTFT p50/p99,
           output tok/s, and each mode's TTFT p50 over ``agg``'s at the same c. Target: a
           separate stage adds at most 15 ms at c=1 (``e-pd`` and ``ep-d`` have one more
           stage than ``agg``, ``e-p-d`` two).
``batch``  One encode worker (mode ``e-pd``) with ``CONVEYOR_ENCODER_MAX_BATCH=1`` (no
           batching) and ``16``: ``--batch-images`` encode tasks of one image each, sent
           at once straight to its queue, each chained to a queue nobody reads;
           images/s = images / time until the last handle is on that queue.
``cache``  Mode ``agg``, c=1, per image: a cold request (a new image), a warm one (the
           same image after other text: an embedding-cache hit, a KV-cache miss) and a
           text-only prompt of the same length; their TTFT medians. Target: warm within
           20% of text-only.

``--json PATH`` writes every request's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import redis  # noqa: E402
from common import CONVEYOR, conveyor_serve, run_parts, session, stream_chunks  # noqa: E402
from PIL import Image  # noqa: E402

from tasks.modes import get_mode  # noqa: E402

MODES = ["agg", "e-pd", "e-p-d", "ep-d"]
EXTRA_STAGES = {"agg": 0, "e-pd": 1, "e-p-d": 2, "ep-d": 1}  # stages beyond agg's one
STAGE_TARGET_MS = 15.0  # TTFT p50 a separate stage may add at c=1
WARM_TARGET = 1.20  # warm-cache image TTFT / text-only TTFT
PRESET = "llava-1.5-like"


# --- Inputs ---------------------------------------------------------------------------
def image(seed: int, size: int = 336) -> bytes:
    """A distinct JPEG drawn from ``seed``: smooth colour fields (a random 8 x 8 image
    scaled up) under light noise, so it compresses like a photo."""
    rng = random.Random(seed)
    smooth = Image.frombytes("RGB", (8, 8), rng.randbytes(8 * 8 * 3))
    smooth = smooth.resize((size, size), Image.Resampling.BICUBIC)
    noise = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    Image.blend(smooth, noise, 0.08).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(raw).decode()


def image_chat(model: str, raw: bytes, text: str, n: int, before: str = "") -> dict:
    content = ([{"type": "text", "text": before}] if before else []) + [
        {"type": "image_url", "image_url": {"url": data_url(raw)}},
        {"type": "text", "text": text},
    ]
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def ensure_model(path: Path | None) -> Path:
    if path is not None:
        return path
    out = Path.home() / ".cache" / "conveyor" / f"bench-{PRESET}"
    if not (out / "config.json").exists():
        print(f"making the {PRESET} model in {out} ...", file=sys.stderr)
        subprocess.run([CONVEYOR, "model", "init", "--preset", PRESET, str(out)],
                       check=True)  # fmt: skip
    return out


# --- One request ----------------------------------------------------------------------
async def timed(client, path: str, body: dict) -> dict:  # type: ignore[no-untyped-def]
    """TTFT (first chunk with text), end time, tokens and prompt size of one stream."""
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    async for now, chunk in stream_chunks(client, path, body):
        choices = chunk.get("choices") or []
        if first is None and choices and (choices[0].get("delta", {}).get("content")
                                          or choices[0].get("text")):  # fmt: skip
            first = now
        if chunk.get("usage"):
            usage = chunk["usage"]
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "start": t0, "end": end,
            "tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            }  # fmt: skip


async def closed_loop(url: str, bodies: list[tuple[str, dict]], c: int) -> tuple[list, float]:
    """Every body sent with exactly ``c`` in flight; (records, wall seconds)."""
    todo = list(reversed(bodies))
    out: list[dict] = []
    async with session(url, c + 2, 600) as client:

        async def lane() -> None:
            while todo:
                path, body = todo.pop()
                out.append(await timed(client, path, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(c)))
        return out, time.perf_counter() - t0


def one(url: str, path: str, body: dict) -> dict:
    """One request on its own."""
    return asyncio.run(closed_loop(url, [(path, body)], 1))[0][0]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(recs: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] * 1000 for r in recs]
    return {"n": len(recs), "ttft_p50": statistics.median(ttft), "ttft_p99": pct(ttft, 99),
            "tok_s": sum(r["tokens"] for r in recs) / wall,
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in recs),
            "cached": sum(r["cached"] for r in recs)}  # fmt: skip


# --- Parts ----------------------------------------------------------------------------
def serve_args(mode: str, args: argparse.Namespace) -> list[str]:
    return ["--mode", mode, "--model", str(args.model), "--kv-transfer", args.kv_transfer,
            "--workers", "1"]  # fmt: skip


def part_modes(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    levels = [int(x) for x in args.concurrency.split(",")]
    model = args.model.name
    res: dict[str, dict[int, dict]] = {}
    for mode in args.modes.split(","):
        want = {p: 1 for p in get_mode(mode).pools}
        env = {"CONVEYOR_DISAGG_MIN_PROMPT_TOKENS": "0", "CONVEYOR_MEDIA_ALLOW_INTERNAL": "true"}
        with conveyor_serve(serve_args(mode, args), log_dir / f"modes-{mode}.log", want,
                            env) as (url, _):  # fmt: skip
            warm = [("/v1/chat/completions", image_chat(model, image(10**6 + i), "Hi?", 4))
                    for i in range(4)]  # fmt: skip
            asyncio.run(closed_loop(url, warm, 2))  # tower, kernels, connections
            seed = 0
            for c in levels:
                n = max(8, args.requests * c)
                bodies = [("/v1/chat/completions",
                           image_chat(model, image(seed + i), f"What is in picture {i}?",
                                      args.output_len)) for i in range(n)]  # fmt: skip
                seed += n
                recs, wall = asyncio.run(closed_loop(url, bodies, c))
                res.setdefault(mode, {})[c] = s = summary(recs, wall)
                out.setdefault("modes", {}).setdefault(mode, {})[c] = {**s, "requests": recs}
                print(
                    f"  {mode:6} c={c:<3} TTFT p50 {s['ttft_p50']:7.1f} ms  p99 "
                    f"{s['ttft_p99']:7.1f} ms  {s['tok_s']:6.1f} tok/s",
                    file=sys.stderr,
                )
    print(
        f"\nModes: 1 image (576 tokens) per request, {args.output_len} output tokens, "
        f"KV/embedding transfer {args.kv_transfer}"
    )
    print("| mode | c | TTFT p50 ms | TTFT p99 ms | tok/s | TTFT p50 over agg | target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, by_c in res.items():
        for c, s in by_c.items():
            base = res.get("agg", {}).get(c)
            over = s["ttft_p50"] - base["ttft_p50"] if base and mode != "agg" else None
            target = ""
            if over is not None and c == 1:
                limit = STAGE_TARGET_MS * EXTRA_STAGES[mode]
                target = f"<= {limit:.0f} ms {'met' if over <= limit else 'MISSED'}"
            print(
                f"| {mode} | {c} | {s['ttft_p50']:.1f} | {s['ttft_p99']:.1f} | "
                f"{s['tok_s']:.1f} | {'' if over is None else f'{over:+.1f} ms'} | {target} |"
            )


def part_batch(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    from api.media import image_hash  # the API's content hash of the decoded pixels
    from kvbm.protocol import ImageRef, Sampling, StagePayload, embedding_key, media_key
    from tasks.app import configure as configure_app
    from tasks.app import declare_queues, queue, route_to
    from tasks.pipeline import TASKS
    from tasks.settings import configure

    rows = []
    rurl = None  # both servers on one Redis port and password: the Celery app's pooled
    for max_batch in (1, 16):  # connections find the second as they found the first
        env = {"CONVEYOR_ENCODER_MAX_BATCH": str(max_batch)}
        log = log_dir / f"batch-{max_batch}.log"
        want = {"encode": 1, "generate": 1}
        with conveyor_serve(serve_args("e-pd", args), log, want, env, redis_url=rurl) as (
            _, rurl,
        ):  # fmt: skip
            r = redis.Redis.from_url(rurl)
            sink = "bench.sink"
            configure_app(configure(redis_url=rurl, mode="e-pd"), extra_queues=[sink])
            declare_queues([sink])
            times = []
            for rnd in range(args.batch_rounds + 1):  # round 0: the tower's first batches
                # new images every round: none in the worker's embedding cache
                seed = 2 * 10**6 + 1000 * rnd
                raws = [image(seed + i) for i in range(args.batch_images)]
                hashes = [image_hash(Image.open(io.BytesIO(raw))) for raw in raws]
                r.mset({media_key(h): raw for h, raw in zip(hashes, raws, strict=True)})
                r.delete(sink)
                sigs = []
                for h in hashes:
                    im = ImageRef(hash=h, offset=5, num_tokens=576)
                    p = StagePayload(request_id=f"bench-{uuid.uuid4().hex}", model="m",
                                     prompt_token_ids=[1] * 600, sampling=Sampling(),
                                     created=time.time(), images=[im])  # fmt: skip
                    body = p.model_dump()
                    sigs.append(TASKS["encode"].si(body).set(queue=queue("encode"))
                                | TASKS["generate"].s(body).set(**route_to(sink)))  # fmt: skip
                t0 = time.perf_counter()
                for s in sigs:
                    s.apply_async()
                while r.llen(sink) < len(sigs):
                    if time.perf_counter() - t0 > 300:
                        raise TimeoutError(f"{r.llen(sink)} of {len(sigs)} images encoded")
                    time.sleep(0.002)
                if rnd:
                    times.append(time.perf_counter() - t0)
                r.delete(sink, *(k for k in r.scan_iter(embedding_key("*", "*"))))
            ips = [args.batch_images / t for t in times]
            rows.append((max_batch, statistics.median(ips), min(ips), max(ips)))
            out.setdefault("batch", {})[max_batch] = ips
    print(
        f"\nEncode worker: {args.batch_images} one-image encode tasks at once, "
        f"median of {args.batch_rounds} rounds"
    )
    print("| CONVEYOR_ENCODER_MAX_BATCH | images/s (median) | min | max |")
    print("| --- | --- | --- | --- |")
    for mb, med, lo, hi in rows:
        print(f"| {mb} | {med:.1f} | {lo:.1f} | {hi:.1f} |")
    if len(rows) == 2:
        print(f"batching gain: {rows[1][1] / rows[0][1]:.2f}x")


def part_cache(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    import transformers

    model = args.model.name
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(7)
    n = args.cache_images
    with conveyor_serve(serve_args("agg", args), log_dir / "cache.log", {"generate": 1},
                        {"CONVEYOR_MEDIA_ALLOW_INTERNAL": "true"}) as (url, _):  # fmt: skip
        warm = [("/v1/chat/completions", image_chat(model, image(3 * 10**6 + i), "Hi?", 4))
                for i in range(3)]  # fmt: skip
        asyncio.run(closed_loop(url, warm, 1))
        recs: dict[str, list[dict]] = {"cold": [], "warm": [], "text": []}
        for i in range(n):
            raw = image(4 * 10**6 + i)
            q = f"Describe picture {i}."
            chat = "/v1/chat/completions"
            cold = one(url, chat, image_chat(model, raw, q, 1))
            # the same image after other text: its embedding cached, no KV block shared
            w = one(url, chat, image_chat(model, raw, q, 1, before=f"Case {i}:"))
            # text only, as many prompt tokens as the warm request (new tokens: no KV hit)
            ids = [rng.randrange(10, tok.vocab_size) for _ in range(w["prompt_tokens"])]
            t = one(url, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1,
                                             "temperature": 0, "ignore_eos": True,
                                             "stream": True})  # fmt: skip
            for k, v in (("cold", cold), ("warm", w), ("text", t)):
                recs[k].append(v)
        out["cache"] = recs
    med = {k: statistics.median(r["ttft"] * 1000 for r in v) for k, v in recs.items()}
    cached = sum(r["cached"] for r in recs["warm"])
    ratio = med["warm"] / med["text"]
    print(
        f"\nEmbedding cache (agg, c=1, {n} images, 1 output token; warm requests reused "
        f"{cached} KV tokens)"
    )
    print("| request | TTFT p50 ms |")
    print("| --- | --- |")
    for k, label in (("cold", "image, cold (tower runs)"),
                     ("warm", "same image after other text (embedding cached, KV not)"),
                     ("text", "text only, same prompt length")):  # fmt: skip
        print(f"| {label} | {med[k]:.1f} |")
    verdict = "met" if ratio <= WARM_TARGET else "MISSED"
    print(f"warm / text-only: {ratio:.2f} (target <= {WARM_TARGET:.2f}: {verdict})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help=f"model dir (default: the {PRESET} preset)")
    ap.add_argument("--parts", default="modes,batch,cache")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per level, x c (>= 8)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-transfer", default="auto", choices=["auto", "nixl", "redis"])
    ap.add_argument("--batch-images", type=int, default=32)
    ap.add_argument("--batch-rounds", type=int, default=3)
    ap.add_argument("--cache-images", type=int, default=12)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-dir", type=Path)
    args = ap.parse_args(argv)
    args.model = ensure_model(args.model).resolve()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-mm-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; logs in {log_dir}", file=sys.stderr)
    parts = {"modes": part_modes, "batch": part_batch, "cache": part_cache}
    return run_parts(parts, args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
