"""Speculative decoding by n-gram lookup in the reference engine: what it buys and costs.

    python bench/spec_decode.py                        # the default tiny model
    python bench/spec_decode.py --model DIR --batch 1,8 --k 2,4 --rounds 3

One engine (``workers.engine.Engine``, in this process; no pipeline) per setting, a batch
of ``--batch`` greedy requests run to ``--output-len`` tokens (``ignore_eos``), prompts of
``--prompt-len`` random tokens with a phrase repeated in them (so the context has n-grams to
look up from the start). Settings: speculation off, then the n-gram method with each
``--k`` draft tokens (lookup 1 to 3 tokens). Per setting: decode tokens per second (after
every request's first token), engine steps, and the share of draft tokens accepted; the
median of ``--rounds`` rounds. The tokens of every setting are checked equal to those
without speculation (greedy: they must be). ``--temperature T`` samples instead (seeded;
drafts go through rejection sampling, so the tokens are not compared).

    python bench/spec_decode.py --prediction           # predicted outputs too

``--prediction`` adds two settings with speculation off but a predicted output (OpenAI's
``prediction``) per request: the tokens the request gives without one (``exact``), and
those tokens with one changed in every ``--edit-every`` (``edited``): what an edit of a
file that is mostly repeated looks like.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from kvbm.protocol import Sampling  # noqa: E402
from tasks.settings import DEFAULT_MODEL_DIR, engine_config  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.engine_api import EngineRequest  # noqa: E402
from workers.model_init import init_model, is_model_dir  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], out_len: int, tag: str,
        temperature: float = 0.0, predictions: list[list[int]] | None = None,
        ) -> tuple[float, int, dict[str, list[int]]]:  # fmt: skip
    """(decode tokens per second, steps, each request's tokens) of one batch."""
    for i, p in enumerate(prompts):
        params = Sampling(temperature=temperature, max_tokens=out_len, ignore_eos=True,
                          seed=1 if temperature else None,
                          prediction=predictions[i] if predictions else None)  # fmt: skip
        assert engine.add_request(EngineRequest(f"{tag}-{i}", p, params)) is None
    steps0 = engine.num_steps
    got: dict[str, list[int]] = {}
    t1 = None
    tokens = 0
    while engine.has_unfinished:
        for o in engine.step():
            if t1 is not None:
                tokens += len(o.token_ids)
            got.setdefault(o.request_id.split("-", 1)[1], []).extend(o.token_ids)
        if t1 is None and len(got) == len(prompts):
            t1 = time.perf_counter()
    assert t1 is not None
    return tokens / (time.perf_counter() - t1), engine.num_steps - steps0, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--k", default="2,4", help="draft tokens per step, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--prediction", action="store_true", help="predicted outputs too")
    ap.add_argument("--edit-every", type=int, default=16,
                    help="edited prediction: one token changed in this many")  # fmt: skip
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not is_model_dir(a.model):
        init_model(a.model)
    rng = random.Random(0)
    batches = [int(b) for b in a.batch.split(",")]
    ks = [int(k) for k in a.k.split(",")]
    settings: list[tuple[str, dict | None]] = [("off", None)] + [
        (f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                          "prompt_lookup_max": 3, "prompt_lookup_min": 1}) for k in ks
    ]  # fmt: skip
    predicted = ["prediction exact", f"prediction edited 1/{a.edit_every}"]
    if a.prediction:
        settings += [(name, None) for name in predicted]
    engines = {}
    for name, spec in settings:
        config = engine_config(num_kv_blocks=4096, max_num_seqs=max(batches),
                               max_num_batched_tokens=max(2048, max(batches) * a.prompt_len),
                               speculative_config=spec)  # fmt: skip
        engines[name] = Engine.from_model_dir(a.model, config)
    vocab = engines["off"].model.cfg.vocab_size

    def prompts(n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            phrase = [rng.randrange(5, vocab) for _ in range(8)]
            body = [rng.randrange(5, vocab) for _ in range(a.prompt_len - 1 - 3 * len(phrase))]
            out.append([1] + body[: len(body) // 2] + phrase * 2 + body[len(body) // 2 :] + phrase)
        return out

    how = f"temperature {a.temperature}" if a.temperature else "greedy"
    print(f"\nn-gram speculative decoding, reference engine, {a.model.name}: prompts "
          f"{a.prompt_len}, {a.output_len} output tokens, {how}, {a.threads} thread(s), "
          f"median of {a.rounds}\n")  # fmt: skip
    print("| batch | setting | decode tok/s | vs off | steps | accepted / draft tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for batch in batches:
        for name, _ in settings:  # warm
            run(engines[name], prompts(batch), 4, f"warm{batch}")
        rates: dict[str, list[float]] = {n: [] for n, _ in settings}
        steps: dict[str, list[int]] = {n: [] for n, _ in settings}
        before = {n: engines[n].stats() for n, _ in settings}
        for r in range(a.rounds):
            ps = prompts(batch)
            want = None
            preds = {}
            if a.prediction:  # the tokens without speculation, as they are and edited
                _, _, plain = run(engines["off"], ps, a.output_len, f"ref{r}", a.temperature)
                exact = [plain[f"{i}"] for i in range(batch)]
                edited = [[t if (j + 1) % a.edit_every else (t + 1) % vocab
                           for j, t in enumerate(toks)] for toks in exact]  # fmt: skip
                preds = dict(zip(predicted, (exact, edited), strict=True))
            for name, _ in settings if r % 2 == 0 else settings[::-1]:
                rate, n_steps, got = run(engines[name], ps, a.output_len, f"{r}{name}",
                                         a.temperature, preds.get(name))  # fmt: skip
                want = want or got
                assert a.temperature or got == want, f"{name}: the tokens differ from another's"
                rates[name].append(rate)
                steps[name].append(n_steps)
        off = statistics.median(rates["off"])
        for name, _ in settings:
            st, st0 = engines[name].stats(), before[name]
            drafted = st.spec_draft_tokens - st0.spec_draft_tokens
            acc = st.spec_accepted_tokens - st0.spec_accepted_tokens
            share = f"{acc / drafted:.0%}" if drafted else "-"
            rate = statistics.median(rates[name])
            print(f"| {batch} | {name} | {rate:.0f} | {rate / off:.2f}x | "
                  f"{statistics.median(steps[name]):.0f} | {share} |")  # fmt: skip


if __name__ == "__main__":
    main()
