"""Block hashes: stable, chained, seeded 64-bit identities of full KV blocks.

The hash of block ``i`` covers (the hash of block ``i-1``, the token ids of block ``i``,
a namespace such as the model, an adapter id or media hashes), so equal hashes mean equal
prefixes. It is xxh3-64 with a fixed seed over a canonical byte encoding — the same value
in the API and in every worker, on every machine (never Python's salted ``hash``). Only
full blocks are hashed; a partial last block has no identity yet.
"""

from __future__ import annotations

import struct

import xxhash

HASH_SEED = 0x5EED_C0DE
ROOT_PARENT = 0  # the parent of a sequence's first block


def namespace_hash(*parts: str) -> int:
    """Fold namespace parts (model id, adapter id, media hashes) into one 64-bit value."""
    return xxhash.xxh3_64_intdigest("\x1f".join(parts).encode(), seed=HASH_SEED)


def block_hash(parent: int, tokens: list[int] | tuple[int, ...], namespace: int = 0) -> int:
    """Hash of one full block given its parent block's hash."""
    payload = struct.pack(f"<QQ{len(tokens)}I", parent, namespace, *tokens)
    return xxhash.xxh3_64_intdigest(payload, seed=HASH_SEED)


def block_hashes(
    token_ids: list[int], block_size: int, namespace: int = 0, start: int = 0,
    parent: int = ROOT_PARENT,
) -> list[int]:  # fmt: skip
    """Chained hashes of every full block of ``token_ids``, from block ``start`` on
    (``parent`` is then the hash of block ``start - 1``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for b in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size : (b + 1) * block_size], namespace)
        out.append(parent)
    return out
