"""LoRA adapters the deployment serves: their PEFT files checked, and their registry in Redis.

A request names an adapter as its ``model`` (vLLM's ``--lora-modules``): the API looks the
name up in the registry (a Redis hash, so an adapter loaded through one API replica is
served by every replica at once) and puts the adapter's name and directory into the stage
payload; the worker that runs the request loads the weights from that directory
(``workers/lora.py``). torch-free: the API reads only ``adapter_config.json``.

Public part:
    LoraRef             an adapter a request runs through: name and files
    LoraError           an adapter that cannot be served, with why (the API's 400)
    AdapterConfig       what ``adapter_config.json`` says, checked: rank, scale, targets
    read_adapter        an adapter directory's config, checked against the rank limit
    parse_lora_modules  the ``lora_modules`` setting: ``name=path,...`` or a JSON list
    LoraRegistry        the adapters in Redis: add, remove, get, all, set_static
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from cluster.keys import lora_registry_key
from cluster.resp import as_str

# the Llama projections an adapter may adapt (PEFT's module names); LoRA on the embeddings
# or the LM head, as vLLM serves for some models, is not served here
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter a request runs through (its ``model`` names it): its name (the
    namespace of its KV blocks, kvbm.protocol.model_namespace) and the directory of its
    PEFT files, which the worker loads (``adapter_config.json`` and the weights). It
    travels in the stage payload (kvbm.protocol.StagePayload.lora)."""

    name: str
    path: str


class LoraError(ValueError):
    """An adapter that cannot be served, and why (the API answers 400 with it)."""


@dataclass(slots=True, frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    # the module names it adapts, as adapter_config.json lists them; None when the file
    # gives a pattern instead (the weights' own names then say which)
    target_modules: tuple[str, ...] | None

    @property
    def scale(self) -> float:
        """What the adapter's update B·A·x is multiplied by (PEFT's ``scaling``)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter(path: str | Path, max_rank: int) -> AdapterConfig:
    """The checked config of the PEFT LoRA adapter in directory ``path``: ``LoraError``
    if the directory or its files are missing, the adapter is not a plain LoRA (DoRA,
    biases, fully trained modules), adapts a module the engine cannot, or its rank is
    above ``max_rank`` (``max_lora_rank``)."""
    d = Path(path)
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"no adapter_config.json in {str(d)!r}")
    if not any((d / f).is_file() for f in WEIGHT_FILES):
        raise LoraError(f"no adapter weights in {str(d)!r} (expected {' or '.join(WEIGHT_FILES)})")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{cfg_file} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{cfg_file} is not a JSON object")
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraError(f"the adapter is a {kind} adapter; only LoRA is served")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"the adapter's rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"the adapter's rank {rank} is above max_lora_rank={max_rank}")
    # what changes the update beyond one rank and one scale for every module, or trains
    # more than A and B: served as a plain LoRA, each would give wrong outputs silently
    unsupported = {k: bool(raw.get(k)) for k in (
        "use_dora", "modules_to_save", "fan_in_fan_out", "lora_bias", "rank_pattern",
        "alpha_pattern", "trainable_token_indices", "target_parameters", "layer_replication",
        "use_qalora")}  # fmt: skip
    unsupported["bias"] = raw.get("bias", "none") not in (None, "none")
    if off := [k for k, v in unsupported.items() if v]:
        raise LoraError(f"the adapter sets {', '.join(off)}, which is not served "
                        "(plain LoRA on the attention and MLP projections only)")  # fmt: skip
    targets = raw.get("target_modules")
    names: tuple[str, ...] | None = None
    if isinstance(targets, list):
        names = tuple(str(t) for t in targets)
        if bad := [t for t in names if t.rsplit(".", 1)[-1] not in TARGET_MODULES]:
            raise LoraError(f"the adapter adapts {', '.join(bad)}; the modules served are "
                            f"{', '.join(TARGET_MODULES)}")  # fmt: skip
    alpha = raw.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, int | float):
        raise LoraError(f"lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), names)


def check_name(name: str) -> str:
    """``name`` if it can name an adapter (``LoraError`` otherwise)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise LoraError(f"an adapter name is 1-128 letters, digits and ._:/@+-, got {name!r}")
    return name


def parse_lora_modules(raw: str | None) -> list[LoraRef]:
    """The ``lora_modules`` setting: ``name=path`` pairs separated by commas or spaces (as
    ``vllm serve --lora-modules`` takes them), or a JSON list of ``{"name", "path"}``."""
    text = (raw or "").strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            items = json.loads(text)
            return [LoraRef(name=check_name(i["name"]), path=str(i["path"])) for i in items]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"lora_modules is not a JSON list of {{name, path}}: {e}") from None
    out = []
    for pair in re.split(r"[,\s]+", text):
        name, sep, path = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"lora_modules entry {pair!r} is not name=path")
        out.append(LoraRef(name=check_name(name), path=path))
    return out


class LoraRegistry:
    """The adapters served, in Redis (one hash): every API replica reads the same."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.key = lora_registry_key()

    async def add(self, ref: LoraRef, static: bool = False) -> bool:
        """Register ``ref`` (replacing one of that name); True if the name was new.
        ``static``: it comes from the ``lora_modules`` setting (see :meth:`set_static`)."""
        entry = {"path": ref.path, "static": True} if static else {"path": ref.path}
        return bool(await self.redis.hset(self.key, ref.name, json.dumps(entry)))

    async def set_static(self, refs: list[LoraRef]) -> list[str]:
        """Make the setting's adapters ``refs`` the static ones: register them, and
        unregister adapters an earlier start registered from the setting that it no longer
        names (the registry outlives an API restart in Redis; an adapter dropped from
        ``lora_modules`` must not stay served, as it would not with ``vllm serve``).
        Adapters loaded at runtime stay. Returns the names unregistered."""
        wanted = {r.name for r in refs}
        found = await self.redis.hgetall(self.key)
        stale = [as_str(k) for k, v in found.items()
                 if json.loads(v).get("static") and as_str(k) not in wanted]  # fmt: skip
        if stale:
            await self.redis.hdel(self.key, *stale)
        for ref in refs:
            await self.add(ref, static=True)
        return stale

    async def remove(self, name: str) -> bool:
        """Unregister ``name``; False if it was not registered."""
        return bool(await self.redis.hdel(self.key, name))

    async def get(self, name: str) -> LoraRef | None:
        raw = await self.redis.hget(self.key, name)
        return None if raw is None else _ref(name, raw)

    async def all(self) -> list[LoraRef]:
        found = await self.redis.hgetall(self.key)
        refs = [_ref(as_str(k), v) for k, v in found.items()]
        return sorted(refs, key=lambda r: r.name)


def _ref(name: str, raw: bytes | str) -> LoraRef:
    return LoraRef(name=name, path=json.loads(raw)["path"])
