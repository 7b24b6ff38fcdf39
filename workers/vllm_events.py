"""vLLM's KV cache events, read from its ZMQ publisher and renamed in Conveyor's block hashes.

vLLM's scheduler publishes ``BlockStored`` (the blocks' vLLM hashes, their parent's, and
their token ids), ``BlockRemoved`` and ``AllBlocksCleared`` on a ZMQ PUB socket
(``--kv-events-config``), numbered, with a ROUTER socket that replays missed batches.
The router's index stays keyed by Conveyor's own block hashes, computed here from the
events' token ids (as Dynamo's router does), so routing depends on neither vLLM's hash
function nor its seed:

* :class:`KVEventTranslator` keeps, per vLLM block it holds, the Conveyor hashes that
  block completed and the tokens it leaves over (a vLLM block need not be a multiple of
  Conveyor's ``block_size``: a leftover is completed by the child block). A child's chain
  starts from its parent's last Conveyor hash, so the same prompt hashes alike in the
  API's router and here. A removed block takes its descendants with it (vLLM can no longer
  reach them from a prompt's start; Conveyor's index assumes a block's ancestors are
  held); a Conveyor hash named by two vLLM blocks goes only when both have.
* :class:`ZmqEventReader` is the subscriber thread: it decodes batches with vLLM's own
  types, asks the replay socket for any batch it missed (a gap in the sequence numbers),
  and hands the translated events to a callback.

Only the device tier's events count (``medium`` GPU, or unset); vLLM's offload tiers and
hybrid models' other KV groups are not Conveyor's index. zmq, msgspec and vLLM are
imported inside :class:`ZmqEventReader` only: this module loads without them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbm.block_pool import KVEvent
from kvbm.protocol import ROOT_PARENT, block_hash, image_extra_key

log = logging.getLogger(__name__)

DEVICE_MEDIA = (None, "GPU")  # vLLM's name for its engine's own KV memory, CPU or GPU


@dataclass(slots=True)
class _Block:
    """A vLLM block the translator holds."""

    parent: object | None  # its parent's vLLM hash
    hashes: list[int]  # the Conveyor blocks it completed
    last: int  # the Conveyor hash its child chains from
    leftover: tuple[int, ...]  # its tokens past its last full Conveyor block
    refs: int = 1  # BlockStored seen minus BlockRemoved seen
    children: set = field(default_factory=set)


class KVEventTranslator:
    """vLLM KV events -> :class:`kvbm.block_pool.KVEvent` in Conveyor's block hashes.

    ``image_tokens`` gives an image's placeholder count by its identifier (the content
    hash Conveyor hands vLLM as the image's uuid): the Conveyor blocks its span covers
    carry :func:`kvbm.protocol.image_extra_key`, as in the API's router. ``lora_namespace``
    gives the namespace of a LoRA adapter's blocks by vLLM's int id of the adapter (an
    event's ``lora_id``), as :func:`kvbm.protocol.model_namespace` names them."""

    def __init__(
        self,
        block_size: int,
        namespace: int,
        image_tokens: Callable[[str], int | None] = lambda _: None,
        lora_namespace: Callable[[int], int | None] = lambda _: None,
    ) -> None:
        self.block_size = block_size
        self.namespace = namespace
        self._image_tokens = image_tokens
        self._lora_namespace = lora_namespace
        self._blocks: dict[object, _Block] = {}
        self._held: Counter[int] = Counter()  # Conveyor hash -> vLLM blocks naming it
        self.unmapped = 0  # stored blocks whose parent was unknown (an event was lost)

    # ----------------------------------------------------------------------------------
    def translate(self, events: Sequence[object]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                if getattr(ev, "medium", None) in DEVICE_MEDIA and not getattr(ev, "group_idx", 0):
                    out += self._stored(ev)
            elif kind == "BlockRemoved":
                if getattr(ev, "medium", None) in DEVICE_MEDIA and not getattr(ev, "group_idx", 0):
                    out += self._removed(ev.block_hashes)  # type: ignore[attr-defined]
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
                self._held.clear()
                out.append(KVEvent("cleared", []))
        return out

    def cached_hashes(self) -> list[int]:
        """Every Conveyor hash held now (the snapshot a resync of the index sends)."""
        return list(self._held)

    @property
    def num_blocks(self) -> int:
        """vLLM blocks held (prefix-cached or in use)."""
        return len(self._blocks)

    # ----------------------------------------------------------------------------------
    def _stored(self, ev) -> list[KVEvent]:
        hashes, tokens = list(ev.block_hashes), list(ev.token_ids)
        if not hashes:
            return []
        per = len(tokens) // len(hashes)
        extra = list(ev.extra_keys or [])
        namespace = self.namespace
        lora_id = getattr(ev, "lora_id", None)
        if lora_id:  # an adapter's blocks: its own namespace (none known: not indexed)
            ns = self._lora_namespace(lora_id)
            if ns is None:
                self.unmapped += len(hashes)
                return []
            namespace = ns
        parent_key = ev.parent_block_hash
        leftover: tuple[int, ...]
        if parent_key is None:
            last, leftover = ROOT_PARENT, ()
        else:
            parent = self._blocks.get(parent_key)
            if parent is None:  # its parent was never seen (or went): nothing to chain from
                self.unmapped += len(hashes)
                return []
            last, leftover = parent.last, parent.leftover
        stored: list[int] = []
        for i, h in enumerate(hashes):
            own = tokens[i * per : (i + 1) * per]
            block = self._blocks.get(h)
            if block is not None:  # seen before (another copy of the same content)
                block.refs += 1
                last, leftover = block.last, block.leftover
                parent_key = h
                continue
            keys = extra[i] if i < len(extra) else None
            run = list(leftover) + own
            new: list[int] = []
            bs = self.block_size
            n_full = len(run) // bs
            for j in range(n_full):
                chunk = run[j * bs : (j + 1) * bs]
                # where this Conveyor block starts within the vLLM block's own tokens
                # (negative: it began with the parent's leftover)
                lo = j * bs - len(leftover)
                last = block_hash(last, chunk, namespace, self._image_keys(keys, lo, bs))
                new.append(last)
            leftover = tuple(run[n_full * bs :])
            self._blocks[h] = _Block(parent_key, new, last, leftover)
            if parent_key is not None and parent_key in self._blocks:
                self._blocks[parent_key].children.add(h)
            for c in new:
                self._held[c] += 1
                if self._held[c] == 1:
                    stored.append(c)
            parent_key = h
        return [KVEvent("stored", stored)] if stored else []

    def _image_keys(self, keys, lo: int, bs: int) -> tuple[str, ...]:
        """The extra keys of the Conveyor block at ``[lo, lo + bs)`` of a vLLM block whose
        event keys are ``keys``: each image (an ``(identifier, offset)`` pair, the offset
        relative to the vLLM block's start) whose placeholder span overlaps it."""
        if not keys:
            return ()
        out = []
        for key in keys:
            if not (isinstance(key, (tuple, list)) and len(key) == 2):
                continue  # a LoRA name or a cache salt: not part of Conveyor's hashes
            ident, offset = str(key[0]), int(key[1])
            n = self._image_tokens(ident)
            if n is None or (offset < lo + bs and offset + n > lo):
                out.append(image_extra_key(ident))
        return tuple(out)

    def _removed(self, vllm_hashes: Sequence[object]) -> list[KVEvent]:
        removed: list[int] = []
        for h in vllm_hashes:
            block = self._blocks.get(h)
            if block is None:
                continue
            block.refs -= 1
            if block.refs <= 0:
                self._drop(h, removed)
        return [KVEvent("removed", removed)] if removed else []

    def _drop(self, h: object, removed: list[int]) -> None:
        """Forget vLLM block ``h`` and its descendants (children first)."""
        stack, order = [h], []
        while stack:
            k = stack.pop()
            block = self._blocks.get(k)
            if block is None:
                continue
            order.append(k)
            stack.extend(block.children)
        for k in reversed(order):
            block = self._blocks.pop(k)
            parent = self._blocks.get(block.parent) if block.parent is not None else None
            if parent is not None:
                parent.children.discard(k)
            for c in block.hashes:
                self._held[c] -= 1
                if self._held[c] <= 0:
                    del self._held[c]
                    removed.append(c)


# --------------------------------------------------------------------------------------
# The subscriber
# --------------------------------------------------------------------------------------
class ZmqEventReader:
    """Reads vLLM's KV event batches from ``endpoint`` on a thread of its own and calls
    ``on_events`` with each batch's events (vLLM objects), in sequence order; a gap is
    filled from ``replay_endpoint`` first."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_events: Callable[[list[object]], None],
        topic: str = "",
    ) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._on_events = on_events
        self._next_seq = 0
        self._stop = threading.Event()
        self.batches = 0
        self.gaps = 0
        self.lost = 0  # batches neither received nor replayed
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)

    def start(self) -> ZmqEventReader:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sub.close(linger=0)

    # ----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._sub, self._zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                _topic, seq_b, payload = self._sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq > self._next_seq:
                    self.gaps += 1
                    self._replay(self._next_seq, seq)
                if seq < self._next_seq:
                    continue  # replayed already
                self._deliver(seq, payload)
            except Exception:  # noqa: BLE001 - keep reading; the index resyncs on its own
                if not self._stop.is_set():
                    log.exception("vLLM KV event reader")

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._next_seq = seq + 1
        self.batches += 1
        self._on_events(list(self._decode(payload).events))

    def _replay(self, start: int, upto: int) -> None:
        """Fetch batches ``start .. upto - 1`` from the replay socket."""
        if self._replay_endpoint is None:
            self.lost += upto - start
            return
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(2000):
                frames = sock.recv_multipart()
                _, _topic, seq_b, payload = frames[-4:]
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    break  # end of the replay
                if self._next_seq <= seq < upto:
                    self._deliver(seq, payload)
        finally:
            sock.close(linger=0)
        if self._next_seq < upto:
            log.warning("vLLM KV events %d..%d lost (beyond the replay buffer)",
                        self._next_seq, upto - 1)  # fmt: skip
            self.lost += upto - self._next_seq
            self._next_seq = upto
