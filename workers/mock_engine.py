"""A mock engine for studying routing at scale: real scheduler and blocks, simulated compute.

:class:`MockEngine` is an :class:`workers.engine_core.EngineCore` like the reference
engine — the same continuous-batching scheduler, the same block pool with prefix caching,
the same KV events, the same detokenization and stop rules — but its steps compute nothing:
a step sleeps as long as a GPU would take for it and yields placeholder tokens (a fixed
text, cycled). It does not import torch and allocates no KV memory, so a small machine can
run 8–64 of them (``conveyor serve --engine mock --workers N``).

A step's time is :class:`workers.mock_timing.MockTiming`'s cost model (per-token prefill,
attention in prefill, a fixed decode step, per-sequence and per-KV-token decode costs),
with named presets such as ``h100-llama8b``.

A prefix-cache hit shows up exactly as it would on a GPU: the cached tokens are never
scheduled, so the step that admits the request is shorter and its first token comes sooner.

KVBM tiers work as on the reference engine (the same bookkeeping, events and loading
state) with no bytes: a block copied between G1 and host memory takes
``host_copy_us_per_block``, one written to or read from disk ``disk_us_per_block``
(:class:`SimulatedCopier`, :class:`kvbm.disk.SimulatedBlockStore`), off the step as real
copies are. Defaults: a block of a Llama-8B-size model (2 MiB) at ~25 GB/s host <-> GPU and
~5 GB/s NVMe.
"""

from __future__ import annotations

import time
from pathlib import Path

from tokenizers import Tokenizer

from kvbm.disk import BlockLayout, SimulatedBlockStore
from workers.checkpoint import TextModelConfig
from workers.engine_api import EngineConfig
from workers.engine_core import EngineCore
from workers.mock_timing import MockTiming
from workers.scheduler import Seq

PLACEHOLDER_TEXT = " lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod"


class SimulatedCopier:
    """Copies between G1 and host memory that only take time (no KV is kept)."""

    def __init__(self, timing: MockTiming) -> None:
        self.block_s = timing.host_copy_us_per_block / 1e6 / timing.speedup

    def g1_to_host(self, pairs: list[tuple[int, int]]) -> None:
        time.sleep(self.block_s * len(pairs))

    def host_to_g1(self, pairs: list[tuple[int, int]]) -> None:
        time.sleep(self.block_s * len(pairs))

    def read(self, tier: int, index: int) -> None:
        return None

    def write_g1(self, block_id: int, data: bytearray | None) -> None:
        pass


class MockEngine(EngineCore):
    name = "mock"
    # Its tokens are placeholders: it ignores what only weighs the choice of a token, as it
    # ignores temperature (penalties, logit_bias, min_p: accepted, no effect), serves what
    # its detokenizer does (include_stop_str_in_output), and refuses what its output could
    # not honour or report (allowed_token_ids, bad_words, logprobs, prompt_logprobs).
    supports = EngineCore.supports | frozenset({
        "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_p",
    })  # fmt: skip

    def __init__(
        self, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int,
        eos_token_ids: list[int], timing: MockTiming, layout: BlockLayout | None = None,
    ) -> None:  # fmt: skip
        super().__init__(tokenizer, config, max_model_len, eos_token_ids)
        self.timing = timing
        if config.host_cache_blocks or config.disk_cache_blocks:
            disk_us = timing.disk_us_per_block / timing.speedup
            self._attach_tiers(SimulatedCopier(timing),
                               layout or BlockLayout(1, 1, 1, config.block_size, "float32"),
                               SimulatedBlockStore(disk_us, disk_us))  # fmt: skip
        ids = [i for i in tokenizer.encode(PLACEHOLDER_TEXT).ids if i not in self.outputs.eos_ids]
        if not ids:
            raise ValueError("the tokenizer encodes the placeholder text to nothing")
        self.placeholder_ids = ids
        self.simulated_seconds = 0.0

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: EngineConfig, timing: MockTiming
    ) -> MockEngine:
        """Only the tokenizer and the config are read (no weights). Without an explicit
        ``max_model_len`` the model's own context window applies."""
        d = Path(model_dir)
        cfg = TextModelConfig.from_dir(d)
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        max_len = config.max_model_len or cfg.max_position_embeddings
        layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size,
                             config.dtype)  # fmt: skip
        return cls(tok, config, max_len, list(cfg.eos_token_ids), timing, layout)

    def _forward(self, batch: list[tuple[Seq, int, int]], sampled: list[Seq]) -> list[int]:
        chunks = [(end - start, end) for seq, start, end in batch if end - start > 1
                  or start < seq.num_prompt]  # fmt: skip
        secs = self.timing.step_seconds(len(batch), chunks, self._step.decode_kv_tokens)
        if secs > 0:
            time.sleep(secs)
        self.simulated_seconds += secs
        ph = self.placeholder_ids
        return [ph[len(seq.output_ids) % len(ph)] for seq in sampled]
