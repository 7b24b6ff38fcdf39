"""The reference engine: the Llama forward pass over a paged KV cache, in torch.

:class:`Engine` is an :class:`workers.engine_core.EngineCore` (scheduler, block
accounting, stop rules) whose steps run one flattened forward pass for the whole batch —
prefill chunks and decode tokens together — and sample each finished row with the
request's own seeded generator. Each step first takes the raw logprobs of the rows that
asked (:mod:`workers.logprobs`, prompt logprobs from extra logits rows), then shapes the
logits (:mod:`workers.logits`: masks, biases, penalties) and samples
(:mod:`workers.sampling`), in vLLM's order.

Image prompts: a request's ``mm_inputs`` give each image's embeddings and the offset of
its placeholder tokens; every step embeds its tokens and replaces the rows that fall inside
an image's span by that image's rows, so a prefill chunk may start or end inside an image
and a preempted request recomputes from the same embeddings. The blocks an image covers
must carry its hash (``block_extra_keys``), or another image's KV could be reused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cluster.lora import LoraError
from kvbm.protocol import Sampling
from workers import paged_kernel
from workers.checkpoint import TextModelConfig, load_text_weights
from workers.engine_api import EngineConfig, EngineRequest, MMInput, RequestOutput, failed
from workers.engine_core import EngineCore, token_seed
from workers.kv_copier import TorchBlockCopier
from workers.llama import AttentionMetadata, LlamaModel, PagedKVCache, PrefillSegment
from workers.logits import process
from workers.logprobs import prompt_rows, record_prompt, take_prompt, token_logprobs
from workers.lora import LoraCache, LoraStep, LoraWeights
from workers.paged_kernel import KernelUnavailable, PagedDecodeKernel
from workers.pooler import TorchPooler
from workers.pooling import PoolingConfig, PoolingUnavailable, load_pooling_config
from workers.sampling import distributions, make_generator, sample, speculative_picks
from workers.scheduler import Seq
from workers.structured import StructuredOutputs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine(EngineCore):
    name = "reference"
    speculates = True  # n-gram drafts checked in the step's forward (workers.spec_decode)
    pooling = PoolingConfig()  # how /v1/embeddings pools (the checkpoint's, from_model_dir)
    supports = EngineCore.supports | {
        "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_p", "allowed_token_ids", "bad_words",
        "include_stop_str_in_output", "structured_outputs", "thinking_token_budget",
    }  # fmt: skip

    def __init__(
        self, model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig,
        image_token_id: int | None = None,  # a vision-language model's placeholder token
    ) -> None:  # fmt: skip
        cfg = model.cfg
        self.image_token_id = image_token_id
        super().__init__(tokenizer, config, config.max_model_len or cfg.max_position_embeddings,
                         cfg.eos_token_ids)  # fmt: skip
        self.model = model
        self.loras = LoraCache(model.w, config.max_loras, config.max_lora_rank)
        self.kv = PagedKVCache(cfg, config.num_kv_blocks, config.block_size, model.dtype,
                               str(model.device))  # fmt: skip
        self.decode_kernel = _decode_kernel(config.decode_attention, config.kernel_dir, model)
        if importlib.util.find_spec("xgrammar") is not None:
            self.structured = StructuredOutputs(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        else:  # (make install puts it in): constrained requests are refused, 400
            log.warning("xgrammar is not installed: structured outputs are not served")
            self.supports = self.supports - {"structured_outputs"}
        # request id -> [its token's logprobs, its prompt's]: this step's, for its outputs
        self._logprobs: dict[str, list] = {}
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
        raw = json.loads((d / "config.json").read_text())
        image_token = raw.get("image_token_index", raw.get("image_token_id"))
        if "vision_config" not in raw:
            image_token = None
        engine = cls(LlamaModel(cfg, weights), tok, config, image_token)
        engine.pooling = load_pooling_config(d)
        return engine

    def pooler(self) -> TorchPooler:
        """What computes embeddings of prompts (workers.pooling runs it between steps)."""
        if self.pooling.unsupported is not None:
            raise PoolingUnavailable(self.pooling.unsupported)
        return TorchPooler(self.model, self.pooling, self.config.block_size, self.max_model_len)

    def add_request(self, req: EngineRequest) -> RequestOutput | None:
        if self.model.classifier:  # no LM head: it classifies (workers.pooler), never samples
            return failed(req.request_id, len(req.prompt_token_ids),
                          "the served model is a sequence classifier: it serves /classify, "
                          "/score and /rerank, not generation", "unsupported_parameter",
                          "model")  # fmt: skip
        if req.lora is not None:  # loaded now: one that cannot be fails the request alone
            try:
                self.loras.get(req.lora)
            except (LoraError, OSError) as e:
                log.warning("[%s] LoRA adapter %r: %s", req.request_id, req.lora.name, e)
                return failed(req.request_id, len(req.prompt_token_ids),
                              f"LoRA adapter {req.lora.name!r} could not be loaded: {e}",
                              "invalid_lora_adapter", "model")  # fmt: skip
        if req.mm_inputs:
            why = self._check_mm(req)
            if why is not None:
                return failed(req.request_id, len(req.prompt_token_ids), why)
            # the embeddings once in the model's dtype and device, in prompt order
            dev, dtype = self.model.device, self.model.dtype
            mm = []
            for m in sorted(req.mm_inputs, key=lambda m: m.offset):
                emb: torch.Tensor = m.embeds  # type: ignore[assignment]
                mm.append(MMInput(m.offset, emb.to(device=dev, dtype=dtype).contiguous()))
            req = dataclasses.replace(req, mm_inputs=mm)
        return super().add_request(req)

    def _adapter(self, req: EngineRequest) -> LoraWeights | None:
        return None if req.lora is None else self.loras.get(req.lora)

    def _make_generator(self, params: Sampling) -> torch.Generator | None:
        return None if params.greedy else make_generator(params.seed)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        data = self.kv.data  # block-major: one row per block, every layer's K and V
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=data.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=data.device)
        data.index_copy_(0, dst, data.index_select(0, src))

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        if self._logprobs:  # this step's logprobs, onto the outputs of their tokens
            for out in outs:
                lps = self._logprobs.pop(out.request_id, None)
                if lps is not None:
                    out.logprobs, out.prompt_logprobs = lps
            self._logprobs.clear()
        return outs

    @torch.inference_mode()  # the logits are inference tensors, processed in place
    def _forward(self, batch: list[tuple[Seq, int, int]], sampled: list[Seq]) -> list[int]:
        rows = prompt_rows(batch)  # none unless a request asks for prompt logprobs
        drafts = self._draft_rows(batch) if self._drafts else []
        logits = self._run(batch, [r for r, _, _ in rows] + [r for r, _ in drafts])
        vocab = logits.shape[-1]
        ending = self._ending_rows
        draft_logits = None
        if drafts:  # the model's pick after each draft's predecessor (workers.spec_decode)
            draft_logits = logits[ending + len(rows) :]
            picks = draft_logits.argmax(-1).tolist()  # greedy ones'; sampled: see below
            for (_, seq), pick in zip(drafts, picks, strict=True):
                self._spec_picks.setdefault(seq.id, []).append(pick)
        if rows:  # the rows past those of the sequences ending in this step
            record_prompt(logits[ending : ending + len(rows)], rows, vocab)
        if rows or drafts:
            logits = logits[:ending]
        if not sampled:
            return []
        logits = self._with_forks(logits)  # a row per sampled sequence, forked choices too
        if self.structured is not None:  # what constrained rows' grammars forbid: -inf
            self.structured.mask(logits, sampled)
        # raw logprobs: the model's (as vLLM's, after a grammar's mask), before anything
        # below shapes the logits
        asked = [i for i, s in enumerate(sampled) if s.req.params.logprobs is not None]
        raw = None
        if asked:
            raw = torch.log_softmax(logits if len(asked) == len(sampled) else logits[asked], -1)
        for seq in sampled:
            if seq.generator is not None and seq.req.params.seed is not None:
                # a seed per (request seed, token index): the same token is drawn whichever
                # worker samples it (prefill or decode, agg or disagg)
                seq.generator.manual_seed(  # type: ignore[attr-defined]
                    token_seed(seq.req.params.seed, len(seq.output_ids))
                )
        logits = process(logits, sampled, [self.outputs.banned(s) for s in sampled])
        tokens = sample(logits, [s.req.params for s in sampled],
                        [s.generator for s in sampled])  # type: ignore[misc]  # fmt: skip
        if draft_logits is not None:
            self._sampled_drafts(draft_logits, drafts, logits, sampled, tokens)
        if raw is not None:
            self._gather_logprobs(raw, [sampled[i] for i in asked], [tokens[i] for i in asked])
        for seq in sampled:  # a first token: the prompt's logprobs go with it
            if seq.req.params.prompt_logprobs is not None and seq.whole_prompt:
                entry = self._logprobs.setdefault(seq.id, [None, None])
                entry[1] = take_prompt(seq, vocab)
        return tokens

    def _sampled_drafts(
        self, draft_logits: torch.Tensor, drafts: list[tuple[int, Seq]], logits: torch.Tensor,
        sampled: list[Seq], tokens: list[int],
    ) -> None:  # fmt: skip
        """A sampled request's drafts are accepted by rejection sampling
        (:func:`workers.sampling.speculative_picks`) over its distributions at the draft
        rows and its ending row; its picks (and its step's last token) are set here."""
        where = {s.id: j for j, s in enumerate(sampled)}
        rows: dict[str, list[int]] = {}
        for i, (_, seq) in enumerate(drafts):
            if not seq.req.params.greedy:
                rows.setdefault(seq.id, []).append(i)
        for sid, idx in rows.items():
            j = where[sid]
            seq = sampled[j]
            p = seq.req.params
            stacked = torch.cat([draft_logits[idx], logits[j : j + 1]])
            probs = distributions(stacked, [p] * len(stacked))
            gen = seq.generator
            assert isinstance(gen, torch.Generator), "a sampled sequence without its generator"
            base = len(seq.output_ids)

            def draw(i: int, gen: torch.Generator = gen, seed: int | None = p.seed,
                     base: int = base) -> torch.Generator:  # fmt: skip
                if seed is not None:  # each token offset its own seed, as one at a time
                    gen.manual_seed(token_seed(seed, base + i))
                return gen

            picks = speculative_picks(probs, self._drafts[sid], draw)
            self._spec_picks[sid] = picks[:-1]
            tokens[j] = picks[-1]

    def _draft_rows(self, batch: list[tuple[Seq, int, int]]) -> list[tuple[int, Seq]]:
        """``(row, seq)`` of every row of a speculating sequence but its last (whose logits
        every ending row has): its last token's and each draft's but the last, in order."""
        out: list[tuple[int, Seq]] = []
        row = 0
        for seq, start, end in batch:
            if seq.id in self._drafts:
                out.extend((r, seq) for r in range(row, row + end - start - 1))
            row += end - start
        return out

    def _gather_logprobs(self, raw: torch.Tensor, seqs: list[Seq], tokens: list[int]) -> None:
        """The sampled tokens' logprobs (a re-prefill's forced first token's, if forced)."""
        for j, seq in enumerate(seqs):
            forced = seq.req.forced_first_token
            if forced is not None and not seq.output_ids:
                tokens[j] = forced
        lps = token_logprobs(raw, tokens, [s.req.params.logprobs or 0 for s in seqs])
        for seq, lp in zip(seqs, lps, strict=True):
            self._logprobs[seq.id] = [[lp], None]

    def _run(
        self, batch: list[tuple[Seq, int, int]], extra_rows: list[int] | None = None
    ) -> torch.Tensor:
        """One forward pass over the batch; logits of the rows that end a sequence, then
        of ``extra_rows`` (indices into the step's flattened tokens)."""
        bs = self.config.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decodes: list[tuple[int, int, list[int]]] = []
        logits_index: list[int] = []
        mm_rows: list[int] = []  # rows of the step that take image embeddings ...
        mm_embeds: list[torch.Tensor] = []  # ... and those embeddings, in row order
        lora: LoraStep | None = None  # rows that run through an adapter, by adapter
        for seq, start, end in batch:
            n = end - start
            table = self.scheduler.block_table(seq.id)
            row = len(ids)
            if seq.adapter is not None:
                lora = lora or LoraStep()
                lora.add(seq.adapter, range(row, row + n))  # type: ignore[arg-type]
            if seq.req.mm_inputs:
                for mm in seq.req.mm_inputs:
                    emb: torch.Tensor = mm.embeds  # type: ignore[assignment]
                    lo, hi = max(start, mm.offset), min(end, mm.offset + emb.shape[0])
                    if lo < hi:
                        mm_rows.extend(range(row + lo - start, row + hi - start))
                        mm_embeds.append(emb[lo - mm.offset : hi - mm.offset])
            elif seq.req.imported is not None and start < seq.num_prompt:
                self._check_recompute(seq, start, end)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decodes.append((row, end, table))
            elif seq.id in self._drafts:  # its last token and drafts: a decode per row (the
                # step's KV is written before attention reads it; each row's context ends
                # at its own position), so they take the decode kernel, as one token would
                decodes.extend((row + i, start + i + 1, table) for i in range(n))
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
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        embeds = None
        if mm_rows:
            embeds = self.model.embed(input_ids)
            rows = torch.tensor(mm_rows, dtype=torch.long, device=dev)
            embeds.index_copy_(0, rows, torch.cat(mm_embeds))
        return self.model.forward(
            input_ids,
            torch.tensor(pos, dtype=torch.long, device=dev),
            attn,
            self.kv,
            torch.tensor(logits_index + (extra_rows or []), dtype=torch.long, device=dev),
            inputs_embeds=embeds,
            lora=lora.finish(len(ids), dev) if lora is not None else None,
        )

    # ----------------------------------------------------------------------------------
    def _check_mm(self, req: EngineRequest) -> str | None:
        """Why ``req.mm_inputs`` cannot run (``None``: they can)."""
        n, hidden = len(req.prompt_token_ids), self.model.cfg.hidden_size
        spans: list[tuple[int, int]] = []
        for m in req.mm_inputs or ():
            e = m.embeds
            if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[1] != hidden:
                shape = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
                return f"image embeddings must be a tensor [tokens, {hidden}], got {shape}"
            if not (0 <= m.offset and m.offset + e.shape[0] <= n):
                return (f"image at offset {m.offset} with {e.shape[0]} tokens lies outside "
                        f"the {n}-token prompt")  # fmt: skip
            spans.append((m.offset, m.offset + e.shape[0]))
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            if start < end:
                return f"images overlap in the prompt (one ends at {end}, the next starts {start})"
        if self.config.enable_prefix_caching:
            keys = req.block_extra_keys or []
            bs = self.config.block_size
            for start, end in spans:
                for b in range(start // bs, min(-(-end // bs), n // bs)):
                    if b >= len(keys) or not keys[b]:
                        return (
                            f"block {b} holds image tokens but no extra key names the "
                            "image: set block_extra_keys (kvbm.protocol.image_extra_key)"
                        )
        return None

    def _check_recompute(self, seq: Seq, start: int, end: int) -> None:
        """An imported request (its prompt's KV pulled from a prefill worker) computes its
        prompt again only after a preemption: without its images' embeddings that would
        embed the placeholder tokens as text and give wrong tokens, so refuse it."""
        img = self.image_token_id
        if img is not None and img in seq.token_ids[start : min(end, seq.num_prompt)]:
            raise RuntimeError(
                f"[{seq.id}] recomputing an image prompt after a preemption, but the "
                "request carries no mm_inputs: give imported image requests their embeddings"
            )


def _decode_kernel(choice: str, kernel_dir: str, model: LlamaModel) -> PagedDecodeKernel | None:
    """The C decode-attention kernel (built in, or found in, ``kernel_dir``) when ``choice``
    asks for it and it can serve ``model``; None for the torch path. ``"kernel"`` raises
    where it cannot."""
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
        return paged_kernel.load(Path(kernel_dir))
    except KernelUnavailable as e:
        if choice == "kernel":
            raise KernelUnavailable(f"decode_attention=kernel: {e}") from e
        log.warning("decode attention: the C kernel is unavailable, using torch's: %s", e)
        return None
