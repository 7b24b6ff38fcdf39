"""The mock engine's cost model (:class:`MockTiming`): how long a GPU would take for a step.

Step time (ms), divided by ``speedup``::

    decode_step_ms                               a step with one sequence (weights read)
  + decode_ms_per_seq  * (sequences in the step - 1)
  + decode_us_per_kv_token / 1000 * (KV tokens the decoding sequences attend to)
  + prefill_us_per_token / 1000 * (prompt tokens computed in the step)
  + prefill_quadratic_us / 1000 * sum over prefill chunks of chunk * context / 1024

Decode is memory-bound: every step reads the weights once (the fixed part) and each
decoding sequence's whole KV context (the part that makes a batch of long contexts slower
than one of short ones). Prefill is compute-bound: a cost per token, and attention's cost
per token per token of context. The scheduler's caps (``max_num_seqs``,
``max_num_batched_tokens``) bound a step, so an overloaded mock worker queues requests as
a GPU would.

Named presets (:data:`MOCK_PROFILES`, ``CONVEYOR_MOCK__PROFILE``) give every figure at once;
settings given beside a profile override its values.

``h100-llama8b`` (Llama-3-8B in bf16 on one H100 SXM), from public figures:

* weights ~16 GB (8.0 B parameters x 2 bytes) read per decode step at ~3.3 TB/s of HBM3:
  ~4.8 ms, plus ~1.2 ms of launches, sampling and scheduling -> ``decode_step_ms`` 6.0
  (vLLM's batch-1 inter-token latency for this model on an H100 is ~6-7 ms);
* per further sequence, its share of the matmuls (2 x 8 B = 16 GFLOP a token at ~550
  TFLOP/s achieved bf16) -> ``decode_ms_per_seq`` 0.03;
* KV per token: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB; read at
  ~3.3 TB/s, ~0.04 µs a token, ~80 % kernel efficiency -> ``decode_us_per_kv_token`` 0.05
  (a batch of 64 at 2k context adds ~6.6 ms a step);
* prefill ~16 GFLOP a token at ~270 TFLOP/s (~27 % of the dense bf16 peak) -> 60 µs a
  token, ~16.7k prompt tokens/s (``prefill_us_per_token`` 60);
* attention in prefill: 4 x 32 layers x 4096 (QK^T and AV) = 0.52 MFLOP per token per
  token of context, 0.54 GFLOP per 1024 of context at ~400 TFLOP/s -> 1.3 µs
  (``prefill_quadratic_us`` 1.3: an 8k-token prompt's tokens cost ~17 % more than a short
  one's).

KV block copies for the KVBM tiers keep their defaults (a 2 MiB block of this model at
~25 GB/s host <-> GPU and ~5 GB/s NVMe).
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> MockTiming fields (the ones a preset sets; the rest keep their defaults)
MOCK_PROFILES: dict[str, dict[str, float]] = {
    "h100-llama8b": {
        "decode_step_ms": 6.0,
        "decode_ms_per_seq": 0.03,
        "decode_us_per_kv_token": 0.05,
        "prefill_us_per_token": 60.0,
        "prefill_quadratic_us": 1.3,
    },
}


@dataclass(slots=True)
class MockTiming:
    prefill_us_per_token: float = 100.0
    prefill_quadratic_us: float = 0.0
    decode_step_ms: float = 5.0
    decode_ms_per_seq: float = 0.05
    decode_us_per_kv_token: float = 0.0
    speedup: float = 1.0
    host_copy_us_per_block: float = 80.0  # one block G1 <-> G2 (KVBM tiers)
    disk_us_per_block: float = 400.0  # one block to or from G3

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError(f"mock speedup must be > 0, got {self.speedup}")
        for name in ("prefill_us_per_token", "prefill_quadratic_us", "decode_step_ms",
                     "decode_ms_per_seq", "decode_us_per_kv_token", "host_copy_us_per_block",
                     "disk_us_per_block"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"mock {name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def profile(cls, name: str, **overrides: float) -> MockTiming:
        """The named preset, with ``overrides`` on top."""
        if name not in MOCK_PROFILES:
            raise ValueError(f"unknown mock profile {name!r}; one of {sorted(MOCK_PROFILES)}")
        return cls(**{**MOCK_PROFILES[name], **overrides})

    def step_seconds(
        self, num_seqs: int, prefill_chunks: list[tuple[int, int]], decode_kv_tokens: int = 0
    ) -> float:
        """Simulated duration of a step with ``num_seqs`` sequences, of which the prefill
        ones compute ``(chunk tokens, context length at the chunk's end)`` and the decoding
        ones attend to ``decode_kv_tokens`` tokens of KV in all."""
        if num_seqs == 0:
            return 0.0
        ms = self.decode_step_ms + self.decode_ms_per_seq * (num_seqs - 1)
        ms += self.decode_us_per_kv_token / 1000 * decode_kv_tokens
        for n, ctx in prefill_chunks:
            ms += self.prefill_us_per_token / 1000 * n
            ms += self.prefill_quadratic_us / 1000 * n * ctx / 1024
        return ms / 1000 / self.speedup
