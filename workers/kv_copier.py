"""The reference engine's side of KVBM tier moves: real bytes between its paged KV cache
(G1) and a host buffer (G2), and a block's bytes for the disk tier (G3).

The host buffer has the engine cache's block shape (``[slots, layers, k|v, block_size,
kv_heads, head_dim]``), so a block is one contiguous run on both sides and a copy is one
``index_copy_`` per batch. On a GPU the buffer is pinned host memory, so copies can
overlap compute. :class:`kvbm.offload.OffloadManager` calls these from its copy threads,
for blocks it has pinned on both ends.
"""

from __future__ import annotations

import torch

from kvbm.disk import BlockLayout
from kvbm.protocol import G1, G2
from workers.llama import PagedKVCache


class TorchBlockCopier:
    def __init__(self, kv: PagedKVCache, host_blocks: int) -> None:
        self.kv = kv
        shape = (host_blocks, *kv.data.shape[1:])
        pin = kv.data.device.type == "cuda"
        # empty, not zeros: a slot is read only after a block was copied into it
        self.host = torch.empty(shape, dtype=kv.data.dtype, pin_memory=pin) if host_blocks else None
        _, layers, _, bs, heads, dim = kv.data.shape
        self.layout = BlockLayout(layers, heads, dim, bs, str(kv.data.dtype).removeprefix("torch."))

    def g1_to_host(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host is not None
        src = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=self.kv.data.device)
        dst = torch.tensor([s for _, s in pairs], dtype=torch.long)
        self.host.index_copy_(0, dst, self.kv.data.index_select(0, src).to("cpu"))

    def host_to_g1(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host is not None
        dev = self.kv.data.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
        rows = self.host.index_select(0, src)
        self.kv.data.index_copy_(0, dst, rows.to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def read(self, tier: int, index: int) -> memoryview:
        if tier == G2:
            assert self.host is not None
            block = self.host[index]
        else:
            assert tier == G1
            block = self.kv.data[index].cpu()
        return block.view(torch.uint8).numpy().data.cast("B")

    def write_g1(self, block_id: int, data: bytearray | None) -> None:
        assert data is not None, "a G3 block read back without its bytes"
        block = torch.frombuffer(data, dtype=self.kv.data.dtype).view(self.kv.data.shape[1:])
        self.kv.data[block_id].copy_(block)
