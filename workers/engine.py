"""The reference engine: the Llama forward pass over a paged KV cache, in torch.

:class:`Engine` is an :class:`workers.engine_core.EngineCore` (scheduler, block
accounting, stop rules) whose steps run one flattened forward pass for the whole batch —
prefill chunks and decode tokens together — and sample each finished row with the
request's own seeded generator.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer

from workers import paged_kernel
from workers.checkpoint import TextModelConfig, load_text_weights
from workers.engine_api import EngineConfig
from workers.engine_core import EngineCore, token_seed
from workers.kv_copier import TorchBlockCopier
from workers.llama import AttentionMetadata, LlamaModel, PagedKVCache, PrefillSegment
from workers.paged_kernel import KernelUnavailable, PagedDecodeKernel
from workers.sampling import SamplingParams, make_generator, sample
from workers.scheduler import Seq

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine(EngineCore):
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        cfg = model.cfg
        super().__init__(tokenizer, config, config.max_model_len or cfg.max_position_embeddings,
                         cfg.eos_token_ids)  # fmt: skip
        self.model = model
        self.kv = PagedKVCache(cfg, config.num_kv_blocks, config.block_size, model.dtype,
                               str(model.device))  # fmt: skip
        self.decode_kernel = _decode_kernel(config.decode_attention, model)
        log.info("decode attention: %s", self.decode_attention)
        if config.host_cache_blocks or config.disk_cache_blocks:  # KVBM tiers: real bytes
            copier = TorchBlockCopier(self.kv, config.host_cache_blocks)
            self._attach_tiers(copier, copier.layout)

    def kv_memory(self) -> PagedKVCache:
        """The paged KV cache: what a KV transfer backend moves blocks of."""
        return self.kv

    @property
    def decode_attention(self) -> str:
        """The decode-attention path this engine runs: ``"kernel"`` or ``"torch"``."""
        return "kernel" if self.decode_kernel is not None else "torch"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig) -> Engine:
        d = Path(model_dir)
        cfg = TextModelConfig.from_dir(d)
        weights = load_text_weights(d, _DTYPES[config.dtype], config.device)
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        return cls(LlamaModel(cfg, weights), tok, config)

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        return None if params.greedy else make_generator(params.seed)

    def _forward(self, batch: list[tuple[Seq, int, int]], sampled: list[Seq]) -> list[int]:
        logits = self._run(batch)
        if not sampled:
            return []
        for seq in sampled:
            if seq.generator is not None and seq.req.params.seed is not None:
                # a seed per (request seed, token index): the same token is drawn whichever
                # worker samples it (prefill or decode, agg or disagg)
                seq.generator.manual_seed(  # type: ignore[attr-defined]
                    token_seed(seq.req.params.seed, len(seq.output_ids))
                )
        return sample(
            logits,
            [s.req.params for s in sampled],
            [s.generator for s in sampled],  # type: ignore[misc]
            [self.outputs.banned(s) for s in sampled],
        )

    def _run(self, batch: list[tuple[Seq, int, int]]) -> torch.Tensor:
        """One forward pass over the batch; logits of the rows that end a sequence."""
        bs = self.config.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decodes: list[tuple[int, int, list[int]]] = []
        logits_index: list[int] = []
        for seq, start, end in batch:
            n = end - start
            table = self.scheduler.block_table(seq.id)
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decodes.append((row, end, table))
            else:
                nb = -(-end // bs)
                bt = torch.tensor(table[:nb], dtype=torch.long, device=self.model.device)
                prefills.append(PrefillSegment(row, n, end, bt))
            if end == seq.num_tokens:
                logits_index.append(len(ids) - 1)
        dev = self.model.device
        attn = AttentionMetadata.build(
            torch.tensor(slots, dtype=torch.long, device=dev),
            prefills,
            decodes,
            bs,
            self.model.cfg.num_layers,
            dev,
            kernel=self.decode_kernel,
        )
        return self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            attn,
            self.kv,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )


def _decode_kernel(choice: str, model: LlamaModel) -> PagedDecodeKernel | None:
    """The C decode-attention kernel when ``choice`` asks for it and it can serve ``model``;
    None for the torch path. ``"kernel"`` raises where it cannot."""
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"decode_attention must be auto, kernel or torch, not {choice!r}")
    if choice == "torch":
        return None
    if model.device.type != "cpu" or model.dtype != torch.float32:
        why = f"it runs float32 on CPU only (model: {model.dtype} on {model.device})"
        if choice == "kernel":
            raise KernelUnavailable(f"decode_attention=kernel: {why}")
        return None
    try:
        return paged_kernel.load()
    except KernelUnavailable as e:
        if choice == "kernel":
            raise KernelUnavailable(f"decode_attention=kernel: {e}") from e
        log.warning("decode attention: the C kernel is unavailable, using torch's: %s", e)
        return None
