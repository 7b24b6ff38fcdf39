"""KV transfer between worker processes: one small interface, several backends.

The prefill side ``export``s a request's KV blocks (they stay pinned in its pool) and gets
back JSON metadata that travels in the Celery handle; the decode side ``pull``s the blocks
into blocks of its own pool using that metadata. Tensors never travel in task payloads.

Both sides describe blocks the same way: the engine's cache is block-major,
``[num_blocks, layers, k|v, block_size, kv_heads, head_dim]``, so one block — every layer,
K and V — is one contiguous run of ``block_bytes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

from cluster.stats import TransferTotals
from workers.llama import PagedKVCache


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, kv: PagedKVCache) -> KVLayout:
        _, layers, _, bs, heads, dim = kv.data.shape
        return cls(layers, heads, dim, bs, str(kv.data.dtype).removeprefix("torch."))

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block: every layer, K and V."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        return asdict(self)


class TransferError(RuntimeError):
    """The blocks could not be moved (peer gone, data missing, timeout)."""


class KVTransfer(ABC):
    """A way to move KV blocks from a prefill worker's pool into a decode worker's pool."""

    name: str = "base"

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.layout = KVLayout.of(kv)
        self.bytes_moved = 0
        self.seconds = 0.0
        self.transfers = 0

    @abstractmethod
    def export(self, request_id: str, block_ids: list[int]) -> dict:
        """Prefill side: make ``block_ids`` pullable; returns JSON metadata for the handle."""

    @abstractmethod
    def pull(self, meta: dict, dst_block_ids: list[int], timeout: float) -> int:
        """Decode side: fill ``dst_block_ids`` with the exported blocks; returns bytes moved.
        Raises :class:`TransferError` when it cannot."""

    def discard(self, request_id: str, meta: dict) -> None:  # noqa: B027 - optional hook
        """Prefill side: the blocks were pulled or abandoned; drop anything staged."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources at shutdown."""

    def stats(self) -> TransferTotals:
        return TransferTotals(self.name, self.bytes_moved, self.seconds, self.transfers)

    def check_layout(self, meta: dict) -> None:
        theirs = meta.get("layout")
        if theirs != self.layout.to_dict():
            raise TransferError(f"KV layout mismatch: peer {theirs}, here {self.layout}")
