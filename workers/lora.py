"""LoRA adapters in the reference engine: their PEFT weights loaded, kept, and applied.

An adapter adds ``scale · B·(A·x)`` to the output of each projection it adapts (PEFT's
LoRA: ``A`` is ``[rank, in]``, ``B`` is ``[out, rank]``). The base weights are never
changed, so one step can run rows of the base model and of several adapters together: each
adapter's update is computed on its own rows only (:class:`LoraStep`).

Public part:
    LoraWeights     one adapter's A and B per projection, in the model's layout and dtype
    load_adapter    read a PEFT adapter directory, checked against the model
    LoraCache       the adapters a worker keeps loaded (``max_loras``, least recent first out)
    LoraStep        which rows of a step run through which adapter
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from cluster.lora import TARGET_MODULES, LoraError, LoraRef, read_adapter
from workers.checkpoint import plain_name

_PEFT_PREFIX = "base_model.model."


@dataclass(slots=True)
class LoraWeights:
    name: str
    path: str
    rank: int
    scale: float
    # a projection's name in the plain Llama layout ("model.layers.0.self_attn.q_proj")
    # -> (A [rank, in], B [out, rank])
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    ref: LoraRef, weights: dict[str, torch.Tensor], max_rank: int
) -> LoraWeights:  # fmt: skip
    """The adapter in ``ref.path``, its tensors in the dtype and device of the model whose
    weights are ``weights`` (plain Llama names). ``LoraError`` if it does not fit the
    model: a projection it does not have, or A / B of the wrong shape. Entries for a
    vision tower or projector (a LLaVA adapter's) are not part of the text model and are
    left out, as the engine runs the vision tower without adapters."""
    cfg = read_adapter(ref.path, max_rank)
    some = weights["model.embed_tokens.weight"]
    raw = _read_tensors(Path(ref.path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:  # "<module>.lora_A.weight" or "<module>.lora_A.default.weight"
                module = name.split(marker, 1)[0]
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise LoraError(f"adapter tensor {key!r} is not a LoRA A or B matrix")
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        plain = plain_name(module + ".weight")
        if plain is None:
            continue  # the vision tower's or the projector's
        plain = plain.removesuffix(".weight")
        base = weights.get(plain + ".weight")
        if base is None or plain.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise LoraError(f"the adapter adapts {module!r}, which the model has no "
                            f"projection for (served: {', '.join(TARGET_MODULES)})")  # fmt: skip
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraError(f"the adapter has {' and '.join(ab)} but not both for {module!r}")
        a, b = ab["lora_A"], ab["lora_B"]
        out_f, in_f = base.shape
        if a.shape != (cfg.rank, in_f) or b.shape != (out_f, cfg.rank):
            want = f"({cfg.rank}, {in_f}) and ({out_f}, {cfg.rank})"
            raise LoraError(f"{module!r}: A is {tuple(a.shape)} and B {tuple(b.shape)}; the "
                            f"model needs {want}")  # fmt: skip
        layers[plain] = (a.to(some.device, some.dtype).contiguous(),
                         b.to(some.device, some.dtype).contiguous())  # fmt: skip
    if not layers:
        raise LoraError(f"the adapter in {ref.path!r} adapts none of the text model's projections")
    return LoraWeights(ref.name, ref.path, cfg.rank, cfg.scale, layers)


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    st = d / "adapter_model.safetensors"
    if st.is_file():
        with safe_open(str(st), framework="pt", device="cpu") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    return torch.load(d / "adapter_model.bin", map_location="cpu", weights_only=True)


class LoraCache:
    """The adapters one engine holds, by name: loaded on first use, the least recently
    used dropped past ``max_loras``. A request keeps its adapter's weights while it runs,
    so dropping one here never pulls it from under a running request."""

    def __init__(self, weights: dict[str, torch.Tensor], max_loras: int, max_rank: int) -> None:
        self.weights = weights
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._held: OrderedDict[str, LoraWeights] = OrderedDict()

    def get(self, ref: LoraRef) -> LoraWeights:
        """``ref``'s weights, loaded now if not held (``LoraError`` if they cannot be).
        An adapter registered again under its name from another path is reloaded."""
        held = self._held.get(ref.name)
        if held is not None and held.path == ref.path:
            self._held.move_to_end(ref.name)
            return held
        loaded = load_adapter(ref, self.weights, self.max_rank)
        self._held[ref.name] = loaded
        self._held.move_to_end(ref.name)
        while len(self._held) > self.max_loras:
            self._held.popitem(last=False)
        return loaded

    def __len__(self) -> int:
        return len(self._held)


# one step's adapters, each with its rows (an index tensor; None: every row of the step)
LoraGroups = list[tuple[LoraWeights, torch.Tensor | None]]


class LoraStep:
    """Which rows of one flattened step run through which adapter (rows of no adapter run
    the base model alone). ``None`` rows: every row of the step is that adapter's."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoraWeights, list[int]]] = []
        self._by_name: dict[str, list[int]] = {}

    def add(self, adapter: LoraWeights, rows: range) -> None:
        got = self._by_name.get(adapter.name)
        if got is None:
            got = self._by_name[adapter.name] = []
            self.groups.append((adapter, got))
        got.extend(rows)

    def finish(self, num_rows: int, device: torch.device) -> LoraGroups:
        """The groups with their rows as index tensors (None: the whole step)."""
        return [(a, None if len(rows) == num_rows else
                 torch.tensor(rows, dtype=torch.long, device=device))
                for a, rows in self.groups]  # fmt: skip


def apply(y: torch.Tensor, x: torch.Tensor, name: str, groups: LoraGroups) -> torch.Tensor:
    """``y`` (the base projection ``name`` of ``x``) plus each adapter's update on its rows,
    computed as PEFT does: ``B(A(x)) · scale``."""
    for adapter, rows in groups:
        ab = adapter.layers.get(name)
        if ab is None:
            continue
        a, b = ab
        if rows is None:
            y = y + F.linear(F.linear(x, a), b) * adapter.scale
        else:
            y = y.index_add(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b),
                            alpha=adapter.scale)  # fmt: skip
    return y
