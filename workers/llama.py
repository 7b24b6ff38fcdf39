"""Llama-family forward pass in plain torch over a paged KV cache.

One call runs a *flattened* batch: the new tokens of every scheduled sequence (prefill
chunks and single decode tokens alike) are concatenated into one ``[T]`` vector, so the
projections and MLPs are single matmuls for the whole step. Each token's K/V is written to
its slot (``block_id * block_size + offset``) in the layer's cache; attention then reads each
sequence's context back through its block table.

The arithmetic follows Hugging Face's ``LlamaForCausalLM`` step for step (float32 RMSNorm,
rotate-half RoPE with cos/sin in float32, SDPA attention) so greedy tokens match
``transformers.generate`` on the same checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.checkpoint import TextModelConfig


@dataclass(slots=True)
class SeqBatchEntry:
    """One sequence's part of a flattened step."""

    num_new: int  # new tokens of this sequence in the step
    context_len: int  # tokens in its KV after the step (cached + new)
    block_table: torch.Tensor  # int64 block ids covering context_len


class PagedKVCache:
    """K and V tensors for every layer: ``[layers, num_blocks, block_size, kv_heads, dim]``."""

    def __init__(
        self,
        cfg: TextModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def bytes_per_block(self) -> int:
        per = self.k[:, 0].numel() * self.k.element_size()
        return 2 * per


class LlamaModel:
    """Weights plus the forward pass; stateless apart from the KV cache it is handed."""

    def __init__(self, cfg: TextModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        if "lm_head.weight" not in weights:
            assert cfg.tie_word_embeddings, "checkpoint has no lm_head and embeddings untied"
            self.w["lm_head.weight"] = weights["model.embed_tokens.weight"]
        some = weights["model.embed_tokens.weight"]
        self.dtype = some.dtype
        self.device = some.device
        self.inv_freq = _rope_inv_freq(cfg).to(self.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    # ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T] flat slot index per token
        seqs: list[SeqBatchEntry],
        kv: PagedKVCache,
        logits_index: torch.Tensor,  # [S] indices into T whose logits are wanted
    ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(logits_index), vocab]``."""
        cfg, w = self.cfg, self.w
        h = w["model.embed_tokens.weight"][input_ids]
        cos, sin = self._rope(positions)
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            x = _rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            attn = self._attention(x, p, layer, cos, sin, slot_mapping, seqs, kv)
            h = h + attn
            x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            h = h + self._mlp(x, p)
        h = h[logits_index]
        h = _rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
        return F.linear(h, w["lm_head.weight"]).float()

    # ----------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate = self._linear(x, p + "mlp.gate_proj")
        up = self._linear(x, p + "mlp.up_proj")
        return self._linear(F.silu(gate) * up, p + "mlp.down_proj")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attention(
        self,
        x: torch.Tensor,
        p: str,
        layer: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        seqs: list[SeqBatchEntry],
        kv: PagedKVCache,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q = self._linear(x, p + "self_attn.q_proj").view(t, cfg.num_heads, cfg.head_dim)
        k = self._linear(x, p + "self_attn.k_proj").view(t, cfg.num_kv_heads, cfg.head_dim)
        v = self._linear(x, p + "self_attn.v_proj").view(t, cfg.num_kv_heads, cfg.head_dim)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)

        k_cache = kv.k[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
        v_cache = kv.v[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)

        groups = cfg.num_heads // cfg.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for s in seqs:
            n, ctx = s.num_new, s.context_len
            qs = q[start : start + n].transpose(0, 1)  # [H, n, D]
            blocks_k = kv.k[layer][s.block_table]  # [nb, bs, KV, D]
            blocks_v = kv.v[layer][s.block_table]
            ks = blocks_k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:ctx].transpose(0, 1)
            vs = blocks_v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:ctx].transpose(0, 1)
            if groups > 1:
                ks = ks.repeat_interleave(groups, dim=0)
                vs = vs.repeat_interleave(groups, dim=0)
            if n == 1:
                o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale)
            elif n == ctx:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            else:  # a prefill chunk after cached context: causal, offset by ctx - n
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return self._linear(out.reshape(t, -1), p + "self_attn.o_proj")


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, D]
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def _rope_inv_freq(cfg: TextModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    )
    rs = cfg.rope_scaling
    if not rs:
        return inv
    if rs["rope_type"] == "linear":
        return inv / float(rs["factor"])
    # llama3: scale low frequencies, keep high ones, blend in between
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)
