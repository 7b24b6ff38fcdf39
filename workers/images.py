"""A worker's images: from a request's ImageRefs to the embeddings its engine needs.

Each image of a prompt is known by its content hash; its bytes wait in Redis
(:func:`kvbm.protocol.media_key`, put there by the API, which checked them). A worker gets
an image's embedding, in this order:

1. from its embedding cache (an image seen before: no vision tower);
2. pulled from another worker that encoded it (an encode worker, or the prefill worker
   of a disaggregated request), through the transfer backend its handle names;
3. encoded here: the bytes from Redis, decoded by Pillow as the API decoded them, the
   model's image processor, the vision tower and projector, all the images that need it
   in one batch.

A pull that fails falls back to encoding here (counted): a request never fails for want of
an encode worker while its bytes are in Redis. torch is imported here: engine processes
only.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import redis
import torch
from PIL import Image

from cluster.stats import ImageCounters
from kvbm.protocol import EmbeddingRef, ImageRef, media_key
from workers.embedding_cache import EmbeddingCache
from workers.engine_api import MMInput
from workers.transfer.base import TransferError
from workers.transfer.embeddings import EmbeddingTransfer

log = logging.getLogger(__name__)


class ImageUnavailable(RuntimeError):
    """An image's bytes are gone from Redis (expired) or cannot be decoded any more."""


def load_image(raw: bytes) -> Image.Image:
    """The image the API checked, decoded the same way (an animation's first frame)."""
    im = Image.open(io.BytesIO(raw))
    im.load()
    return im


class ImageEncoder:
    """The vision tower behind an embedding cache. Thread-safe; the tower is loaded on
    first use (a text-only request never pays for it)."""

    def __init__(self, model_dir: str | Path, client: redis.Redis, cache_mb: int,
                 dtype: str = "float32", device: str = "cpu") -> None:  # fmt: skip
        self._model_dir = Path(model_dir)
        self._r = client
        self._dtype = dtype
        self._device = device
        self._encoder = None
        self._lock = threading.Lock()  # one batch through the tower at a time
        self.cache = EmbeddingCache(cache_mb << 20)
        self.stats = ImageCounters()  # the tower's and the pulls' (the cache keeps its own)

    def counters(self) -> ImageCounters:
        """The tower's and the cache's counters, for the heartbeat."""
        c = self.cache.stats()
        return replace(self.stats, cache_hits=c.hits, cache_misses=c.misses,
                       cache_evictions=c.evictions, cache_entries=c.entries, cache_bytes=c.bytes,
                       cache_max_bytes=c.max_bytes)  # fmt: skip

    def encode(self, images: Sequence[ImageRef]) -> list[torch.Tensor]:
        """Each image's embedding ``[num_tokens, hidden]``: from the cache, or through the
        tower, the missing ones in one batch. Raises :class:`ImageUnavailable`."""
        out: dict[str, torch.Tensor] = {}
        missing: list[ImageRef] = []
        for im in images:
            if im.hash in out:
                continue
            emb = self.cache.get(im.hash)
            if emb is None:
                missing.append(im)
            else:
                out[im.hash] = emb
        if missing:
            for im, emb in zip(missing, self._run(missing), strict=True):
                self.cache.put(im.hash, emb)
                out[im.hash] = emb
        for im in images:
            rows = out[im.hash].shape[0]
            if rows != im.num_tokens:
                raise ImageUnavailable(f"image {im.hash[:12]} encodes to {rows} rows, its "
                                       f"prompt has {im.num_tokens} placeholders")  # fmt: skip
        return [out[im.hash] for im in images]

    def _run(self, images: list[ImageRef]) -> list[torch.Tensor]:
        # a binary client (decode_responses=False): bytes
        raws = cast("list[bytes | None]", self._r.mget([media_key(im.hash) for im in images]))
        pils = []
        for im, raw in zip(images, raws, strict=True):
            if raw is None:
                raise ImageUnavailable(f"image {im.hash[:12]} is no longer in Redis (expired)")
            try:
                pils.append(load_image(raw))
            except Exception as e:  # noqa: BLE001 - the API decoded it once: say so plainly
                raise ImageUnavailable(f"image {im.hash[:12]} cannot be decoded: {e}") from e
        with self._lock:
            t0 = time.perf_counter()
            encoder = self._tower()
            embeds = encoder.encode(encoder.preprocess(pils))
            self.stats.encode_seconds += time.perf_counter() - t0
            self.stats.images_encoded += len(images)
            self.stats.encode_batches += 1
        return [e.contiguous() for e in embeds]

    def _tower(self):
        if self._encoder is None:
            from workers.vision import VisionEncoder

            self._encoder = VisionEncoder.from_model_dir(self._model_dir, self._dtype,
                                                         self._device)  # fmt: skip
        return self._encoder


def prepare(
    images: Sequence[ImageRef],
    refs: Sequence[EmbeddingRef],
    encoder: ImageEncoder,
    transfer: EmbeddingTransfer | None,
    timeout: float,
) -> list[MMInput]:
    """The engine's inputs for a request's images: pulled where ``refs`` name them (and
    this worker has no copy), encoded here otherwise or if the pull fails."""
    by_hash = {r.hash: r for r in refs}
    pulled: dict[str, torch.Tensor] = {}
    for im in images:
        ref = by_hash.get(im.hash)
        if ref is None or im.hash in pulled or im.hash in encoder.cache:
            continue
        if transfer is None:
            encoder.stats.pull_fallbacks += 1
            continue
        try:
            pulled[im.hash] = transfer.pull(ref.transfer, timeout)
            encoder.stats.images_pulled += 1
            encoder.cache.put(im.hash, pulled[im.hash])
        except (TransferError, OSError, redis.RedisError) as e:
            encoder.stats.pull_fallbacks += 1
            log.warning("embedding of image %s not pulled (%s): encoding it here",
                        im.hash[:12], e)  # fmt: skip
    if transfer is not None:  # staged copies not pulled (this worker had its own): free them
        for ref in refs:
            if ref.hash not in pulled:
                try:
                    transfer.decline(ref.transfer)
                except (TransferError, OSError, redis.RedisError) as e:
                    log.debug("staged embedding of image %s not declined: %s", ref.hash[:12], e)
    need = [im for im in images if im.hash not in pulled]
    encoded = dict(zip((im.hash for im in need), encoder.encode(need), strict=True))
    return [MMInput(im.offset, pulled[im.hash] if im.hash in pulled else encoded[im.hash])
            for im in images]  # fmt: skip


def export(
    request_id: str, images: Sequence[ImageRef], embeds: Sequence[torch.Tensor],
    transfer: EmbeddingTransfer,
) -> list[EmbeddingRef]:  # fmt: skip
    """Stage each image's embedding once for the next worker to pull."""
    refs: dict[str, EmbeddingRef] = {}
    for im, emb in zip(images, embeds, strict=True):
        if im.hash not in refs:
            meta = transfer.export(request_id, im.hash, emb)
            refs[im.hash] = EmbeddingRef(hash=im.hash, transfer=meta)
    return list(refs.values())
