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
import mmap
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.checkpoint import TextModelConfig
from workers.lora import LoraGroups
from workers.lora import apply as apply_lora
from workers.paged_kernel import PagedDecodeKernel


@dataclass(slots=True)
class PrefillSegment:
    """A prefill chunk in the flattened step: rows ``start:start+n`` of the batch."""

    start: int
    num_new: int  # new tokens of this sequence in the step
    context_len: int  # tokens in its KV after the step (cached + new)
    block_table: torch.Tensor  # int64 block ids covering context_len
    # rows of those blocks' layer-0 K in the cache's block view (set by AttentionMetadata)
    block_rows: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """How one flattened step's rows map onto sequences and KV slots.

    Decode rows (one new token each) are attended in one batched call: their contexts are
    gathered a whole block at a time (padded to the most blocks any of them has) and
    masked by ``decode_mask``; or, with the C kernel (``workers/paged_kernel.py``), read
    in place through ``decode_table`` up to ``decode_lens``, with nothing gathered. Prefill
    chunks are attended one by one (few and long).

    Two views of the cache are indexed. New tokens are written as rows of the cache viewed
    flat as ``[blocks * layers * 2 * block_size, heads, dim]``: a token's row for (layer,
    k|v) is its base + (2 * layer + k|v) * block_size. Contexts are read as blocks of the
    cache viewed as ``[blocks * layers * 2, block_size, heads, dim]``: block b's (layer,
    k|v) is row b * 2 * layers + 2 * layer + k|v, one contiguous run, copied whole rather
    than token by token (docs/performance.md, "KV contexts copied a block at a time")."""

    slot_base: torch.Tensor  # [T] base row of each new token
    prefills: list[PrefillSegment]
    decode_rows: torch.Tensor | None = None  # [D] rows (in the step) of the decode tokens
    decode_blocks: torch.Tensor | None = None  # [D * nb] block-view rows of their contexts
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, nb * block_size] True where valid
    # with the C kernel, its view of the same decodes instead: block ids [D, nb], context
    # lengths [D] and the longest of them
    decode_kernel: PagedDecodeKernel | None = None
    decode_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_longest: int = 0

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        prefills: list[PrefillSegment],
        decodes: list[tuple[int, int, list[int]]],  # (row, context_len, block ids)
        block_size: int,
        num_layers: int,
        device: torch.device | str = "cpu",
        kernel: PagedDecodeKernel | None = None,  # decode attention by the C kernel
    ) -> AttentionMetadata:
        stride = 2 * num_layers * block_size  # flat rows per block
        base = slot_mapping // block_size * stride + slot_mapping % block_size
        for seg in prefills:
            seg.block_rows = seg.block_table * (2 * num_layers)
        meta = cls(base, prefills)
        if decodes:
            longest = max(ctx for _, ctx, _ in decodes)
            nb = -(-longest // block_size)
            rows = [(blocks[:nb] + [0] * (nb - len(blocks)))[:nb] for _, _, blocks in decodes]
            table = torch.tensor(rows, dtype=torch.long)
            lens = torch.tensor([ctx for _, ctx, _ in decodes], dtype=torch.long)
            meta.decode_rows = torch.tensor([r for r, _, _ in decodes], device=device)
            if kernel is not None:
                meta.decode_kernel, meta.decode_table, meta.decode_lens = kernel, table, lens
                meta.decode_longest = longest
            else:
                pos = torch.arange(nb * block_size, dtype=torch.long)
                meta.decode_blocks = (table * (2 * num_layers)).flatten().to(device)
                meta.decode_mask = (pos[None, :] < lens[:, None]).to(device)[:, None, None, :]
        return meta


class PagedKVCache:
    """The KV cache, block-major: ``data[block, layer, k|v, slot, kv_head, dim]``.

    One block (all layers, K and V) is one contiguous run of memory, so moving a block to
    another worker is one region, not two per layer. ``k`` and ``v`` are views in the
    layer-major shape ``[layers, num_blocks, block_size, kv_heads, dim]``."""

    def __init__(
        self,
        cfg: TextModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        self._mapping: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            self.data, self._mapping = _huge_page_zeros(shape, dtype)
            # Fault every page in now, as a GPU pool is written when allocated. Left lazy,
            # the first write to each page faults in the middle of a step, and a fresh
            # worker's KV writes are slow until the pool has handed out every block once
            # (docs/performance.md, "KV pool faulted in at start").
            self.data.zero_()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def k(self) -> torch.Tensor:
        return self.data[:, :, 0].transpose(0, 1)

    @property
    def v(self) -> torch.Tensor:
        return self.data[:, :, 1].transpose(0, 1)

    def block_view(self) -> torch.Tensor:
        """``[num_blocks * layers * 2, block_size, heads, dim]``: one row per block, layer
        and K/V (see :class:`AttentionMetadata`)."""
        return self.data.view(-1, *self.data.shape[3:])


class LlamaModel:
    """Weights plus the forward pass; stateless apart from the KV cache it is handed."""

    def __init__(self, cfg: TextModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        # a sequence classifier (its head: score) has no LM head and generates nothing
        self.classifier = "score.weight" in weights
        if "lm_head.weight" not in weights and not self.classifier:
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
        attn: AttentionMetadata,
        kv: PagedKVCache,
        logits_index: torch.Tensor,  # [S] indices into T whose logits are wanted
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: rows used instead of ids
        lora: LoraGroups | None = None,  # rows that run through LoRA adapters
    ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(logits_index), vocab]``. With
        ``inputs_embeds`` (:meth:`embed` of the ids, some rows replaced by an image's
        embeddings) the layers read those rows and ``input_ids`` is not looked up. With
        ``lora`` each adapter's update joins the projections of its rows."""
        h = self.hidden_states(input_ids, positions, attn, kv, logits_index, inputs_embeds,
                               lora)  # fmt: skip
        return F.linear(h, self.w["lm_head.weight"]).float()

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv: PagedKVCache,
        rows: torch.Tensor,  # [S] indices into T whose hidden states are wanted
        inputs_embeds: torch.Tensor | None = None,
        lora: LoraGroups | None = None,
    ) -> torch.Tensor:
        """Run one step; returns the last layer's hidden states of ``rows`` after the final
        norm ``[S, hidden]`` (what the LM head reads, and what embeddings pool)."""
        cfg, w = self.cfg, self.w
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self._rope(positions)
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            x = _rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            attn_out = self._attention(x, p, layer, cos, sin, attn, kv, lora)
            h = h + attn_out
            x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            h = h + self._mlp(x, p, lora)
        return _rms_norm(h[rows], w["model.norm.weight"], cfg.rms_norm_eps)

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's head on hidden states ``[..., hidden]``: float32 logits
        ``[..., num_labels]`` (Hugging Face's ``score`` layer, before any activation)."""
        return F.linear(h, self.w["score.weight"], self.w.get("score.bias")).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[T, hidden]`` of ``input_ids``."""
        return self.w["model.embed_tokens.weight"][input_ids]

    # ----------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str, lora: LoraGroups | None = None) -> torch.Tensor:
        y = F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))
        return y if not lora else apply_lora(y, x, name, lora)

    def _mlp(self, x: torch.Tensor, p: str, lora: LoraGroups | None = None) -> torch.Tensor:
        gate = self._linear(x, p + "mlp.gate_proj", lora)
        up = self._linear(x, p + "mlp.up_proj", lora)
        return self._linear(F.silu(gate) * up, p + "mlp.down_proj", lora)

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
        attn: AttentionMetadata,
        kv: PagedKVCache,
        lora: LoraGroups | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = self._linear(x, p + "self_attn.q_proj", lora).view(t, nh, hd)
        k = self._linear(x, p + "self_attn.k_proj", lora).view(t, nkv, hd)
        v = self._linear(x, p + "self_attn.v_proj", lora).view(t, nkv, hd)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)

        flat = kv.data.view(-1, nkv, hd)
        k_off, v_off = 2 * layer * kv.block_size, (2 * layer + 1) * kv.block_size
        flat.index_copy_(0, attn.slot_base + k_off, k)
        flat.index_copy_(0, attn.slot_base + v_off, v)

        blocks = kv.block_view()
        groups = nh // nkv
        out = torch.empty_like(q)
        if attn.decode_rows is not None and attn.decode_kernel is not None:
            assert attn.decode_table is not None and attn.decode_lens is not None
            qd = q[attn.decode_rows]  # [D, H, hd], a contiguous copy
            od = torch.empty_like(qd)
            attn.decode_kernel(kv.data, layer, qd, attn.decode_table, attn.decode_lens,
                               attn.decode_longest, self.scale, od)  # fmt: skip
            out[attn.decode_rows] = od
        elif attn.decode_rows is not None:
            assert attn.decode_blocks is not None and attn.decode_mask is not None
            d, span = attn.decode_mask.shape[0], attn.decode_mask.shape[-1]
            qd = q[attn.decode_rows].unsqueeze(2)  # [D, H, 1, hd]
            kd = blocks.index_select(0, attn.decode_blocks + 2 * layer)
            vd = blocks.index_select(0, attn.decode_blocks + 2 * layer + 1)
            kd = kd.view(d, span, nkv, hd).transpose(1, 2)  # [D, KV, nb * block_size, hd]
            vd = vd.view(d, span, nkv, hd).transpose(1, 2)
            if groups > 1:
                kd = kd.repeat_interleave(groups, dim=1)
                vd = vd.repeat_interleave(groups, dim=1)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=attn.decode_mask, scale=self.scale
            )
            out[attn.decode_rows] = od.squeeze(2)
        for seg in attn.prefills:
            n, ctx = seg.num_new, seg.context_len
            assert seg.block_rows is not None
            qs = q[seg.start : seg.start + n].transpose(0, 1)  # [H, n, hd]
            ks = blocks.index_select(0, seg.block_rows + 2 * layer)
            vs = blocks.index_select(0, seg.block_rows + 2 * layer + 1)
            ks = ks.reshape(-1, nkv, hd)[:ctx].transpose(0, 1)  # [KV, ctx, hd]
            vs = vs.reshape(-1, nkv, hd)[:ctx].transpose(0, 1)
            if groups > 1:
                ks = ks.repeat_interleave(groups, dim=0)
                vs = vs.repeat_interleave(groups, dim=0)
            if n == ctx:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            else:  # a chunk after cached context: causal, offset by ctx - n
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[seg.start : seg.start + n] = o.transpose(0, 1)
        return self._linear(out.reshape(t, -1), p + "self_attn.o_proj", lora)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _huge_page_zeros(
    shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed CPU tensor on anonymous memory advised to use 2 MiB pages: fewer TLB misses
    and far fewer page-sized pieces for a process-to-process copy such as NIXL's over
    UCX/cma (docs/performance.md, "KV pool on 2 MiB pages"). Falls back to ``torch.zeros``
    where the advice is unavailable."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < (2 << 20):
        return torch.zeros(shape, dtype=dtype), None
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(advice)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype), None
    with warnings.catch_warnings():  # anonymous memory is writable; silence the caution
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
    return t, mapping  # the mapping must outlive the tensor: the cache keeps both


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
