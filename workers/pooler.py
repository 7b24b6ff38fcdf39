"""The reference engine's embeddings: a prompt's last-layer hidden states (after the final
norm, what the LM head reads and what vLLM's pooler pools), pooled as the model says.

A job runs the prompt through :meth:`workers.llama.LlamaModel.hidden_states` in chunks,
each chunk attending to the ones before it through a KV cache of the job's own (a
:class:`workers.llama.PagedKVCache` just large enough for the prompt, freed with the job):
the engine's block pool, its prefix cache and its scheduler are never touched. Pooling is
accumulated chunk by chunk in float32 (the last token's row, the first's, or the sum of
every row for a mean), then the vector is cut to ``dimensions`` and L2-normalised, in
that order, as vLLM's embedding head does. A classification job (``task`` classify) runs
the last token's row through the classifier's head instead and keeps its raw logits.
When and where it runs: :mod:`workers.pooling`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbm.protocol import Pooling
from workers.llama import AttentionMetadata, LlamaModel, PagedKVCache, PrefillSegment
from workers.pooling import PoolingConfig, PoolingUnavailable

NORM_EPS = 1e-12  # torch.nn.functional.normalize's (vLLM normalises with it too)


class TorchPooler:
    """Starts embedding jobs on ``model`` (a :class:`workers.pooling.Pooler`)."""

    def __init__(self, model: LlamaModel, config: PoolingConfig, block_size: int,
                 max_model_len: int) -> None:  # fmt: skip
        self.model = model
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len

    def start(self, token_ids: list[int], params: Pooling) -> EmbeddingJob:
        if params.task == "classify" and not self.model.classifier:
            raise PoolingUnavailable("the served model has no classification head (the "
                                     "score layer of a *ForSequenceClassification)")  # fmt: skip
        n, vocab = len(token_ids), self.model.cfg.vocab_size
        if not 0 < n <= self.max_model_len:
            raise ValueError(f"an embedding input has {n} tokens; it must have 1 to "
                             f"{self.max_model_len}")  # fmt: skip
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"an embedding input has token ids outside [0, {vocab})")
        return EmbeddingJob(self, token_ids, params)


class EmbeddingJob:
    """One prompt's embedding, a chunk per :meth:`step` (:class:`workers.pooling.EmbeddingJob`)."""

    def __init__(self, pooler: TorchPooler, token_ids: list[int], params: Pooling) -> None:
        m = pooler.model
        self.model = m
        self.classify = params.task == "classify"
        # a classifier reads its head off the last token (Hugging Face's and vLLM's pooling)
        self.type = "last" if self.classify else pooler.config.type
        self.normalize = pooler.config.normalize if params.normalize is None else params.normalize
        self.dimensions = params.dimensions
        self.bs = pooler.block_size
        self.ids = torch.tensor(token_ids, dtype=torch.long, device=m.device)
        n = len(token_ids)
        blocks = -(-n // self.bs)
        self.kv = PagedKVCache(m.cfg, blocks, self.bs, m.dtype, str(m.device))
        self.table = torch.arange(blocks, dtype=torch.long, device=m.device)  # block i: i
        self.computed = 0  # prompt tokens run so far
        self.pooled = torch.zeros(m.cfg.hidden_size, dtype=torch.float32, device=m.device)

    @property
    def done(self) -> bool:
        return self.computed == len(self.ids)

    def step(self, max_tokens: int) -> None:
        assert not self.done, "step() of a finished embedding job"
        start = self.computed
        end = min(len(self.ids), start + max_tokens)
        n = end - start
        m, dev = self.model, self.model.device
        pos = torch.arange(start, end, dtype=torch.long, device=dev)
        seg = PrefillSegment(0, n, end, self.table[: -(-end // self.bs)])
        # slot of position p is p (block p // bs holds it at p % bs: the table is 0, 1, ...)
        attn = AttentionMetadata.build(pos, [seg], [], self.bs, m.cfg.num_layers, dev)
        if self.type == "mean":
            rows = torch.arange(n, device=dev)
        elif self.type == "cls":
            rows = torch.arange(1 if start == 0 else 0, device=dev)
        else:  # last: only the prompt's last row is wanted
            rows = torch.arange(n - 1, n if end == len(self.ids) else n - 1, device=dev)
        h = m.hidden_states(self.ids[start:end], pos, attn, self.kv, rows)
        self.pooled += h.float().sum(0)
        self.computed = end
        if self.done:
            del self.kv  # its memory goes back before the vector is read

    def result(self) -> bytes:
        assert self.done, "result() of an unfinished embedding job"
        if self.classify:  # the head's raw logits: the API applies the activation
            logits = self.model.classify(self.pooled.to(self.model.dtype))
            return logits.cpu().numpy().astype("<f4").tobytes()
        v = self.pooled / len(self.ids) if self.type == "mean" else self.pooled
        if self.dimensions is not None:
            v = v[: self.dimensions]
        if self.normalize:
            v = F.normalize(v, p=2, dim=0, eps=NORM_EPS)
        return v.cpu().numpy().astype("<f4").tobytes()
