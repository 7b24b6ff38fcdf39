"""Speculative decoding (``CONVEYOR_SPECULATIVE_CONFIG``, n-gram) through the real pipeline:
a deployment whose workers speculate gives the session cluster's greedy tokens (the same
model without it), aggregated and disaggregated, streamed and not; its /metrics count the
drafts and the accepted tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import (
    Cluster,
    Proc,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})  # fmt: skip
PHRASE = [17, 230, 44, 91, 300, 12]
PROMPTS = [[1] + [5 + (s * 131 + i * 37) % 507 for i in range(20 + 7 * s)] + PHRASE * (1 + s % 3)
           for s in range(6)]  # fmt: skip


@pytest.fixture(scope="module")
def speculating(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """An aggregated worker and a P/D pair that speculate, each pool behind its own API:
    (agg url, disagg url)."""
    logdir = tmp_path_factory.mktemp("spec")
    url = redis_dbs.take(__name__)
    agg_env = base_env(url, tiny_model_dir, CONVEYOR_SPECULATIVE_CONFIG=SPEC)
    pd_env = base_env(url, tiny_model_dir, CONVEYOR_SPECULATIVE_CONFIG=SPEC,
                      CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
                      CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    procs: list[Proc] = [start_worker("spec-w", "generate", "spec-w", agg_env, logdir)]
    with stop_on_error(*procs):
        procs += [start_worker("spec-p", "prefill", "spec-p", pd_env, logdir),
                  start_worker("spec-d", "decode", "spec-d", pd_env, logdir)]  # fmt: skip
        agg, agg_url = start_api("spec-api", agg_env, logdir)
        procs.append(agg)
        pd, pd_url = start_api("spec-pd-api", pd_env, logdir)
        procs.append(pd)
        wait_for(lambda: httpx.get(f"{agg_url}/health").status_code == 200
                 and httpx.get(f"{pd_url}/health").json()["workers"] == {"prefill": 1,
                                                                         "decode": 1},
                 90, "workers", procs)  # fmt: skip
    yield agg_url, pd_url
    for p in procs:
        p.stop()


def _complete(url: str, model: str, prompt: list[int], stream: bool = False,
              sampled: bool = False) -> list[str]:  # fmt: skip
    """Greedy; or ``sampled`` at temperature 1 with top_k 1 (drafts then go through
    rejection sampling, and a one-token distribution gives the greedy tokens)."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    body = {"ignore_eos": True, "return_token_ids": True, **({"top_k": 1} if sampled else {})}
    kw = {"model": model, "prompt": prompt, "max_tokens": 30,
          "temperature": 1.0 if sampled else 0, "extra_body": body}  # fmt: skip
    if not stream:
        ch = c.completions.create(**kw).choices[0]  # type: ignore[call-overload]
        return [ch.text, *map(str, ch.model_extra["token_ids"])]
    text, ids = "", []
    for chunk in c.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].text
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return [text, *map(str, ids)]


def test_speculating_workers_give_the_plain_tokens(speculating: tuple[str, str],
                                                  cluster: Cluster) -> None:  # fmt: skip
    agg_url, pd_url = speculating
    for p in PROMPTS:
        want = _complete(cluster.url, cluster.model_name, p)
        assert _complete(agg_url, cluster.model_name, p) == want
        assert _complete(pd_url, cluster.model_name, p) == want
        assert _complete(agg_url, cluster.model_name, p, stream=True) == want
        assert _complete(agg_url, cluster.model_name, p, sampled=True) == want
    # what it did, in the metrics (from heartbeats): drafts on the aggregated worker and
    # on the decode worker
    for url, pool, wid in ((agg_url, "generate", "spec-w"), (pd_url, "decode", "spec-d")):
        wait_for(lambda u=url, p=pool, w=wid: _counter(u, p, w, "num_drafts") > 0, 10,
                 "a heartbeat with the counters")  # fmt: skip
        accepted = _counter(url, pool, wid, "num_accepted_tokens")
        assert 0 < accepted <= _counter(url, pool, wid, "num_draft_tokens")


def _counter(url: str, pool: str, wid: str, name: str) -> float:
    pat = rf'^conveyor_spec_decode_{name}_total{{pool="{pool}",worker="{wid}"}} (\S+)$'
    found = re.search(pat, httpx.get(f"{url}/metrics").text, re.M)
    assert found, name
    return float(found.group(1))
