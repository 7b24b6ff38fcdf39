"""The stage table: each serving mode's chain of stages, and the pool each stage runs on.

Everything that depends on the mode derives from this table: the chain the API sends
(:mod:`tasks.pipeline`), the pools ``conveyor serve`` starts and ``conveyor worker
--pool`` accepts, the pools ``/health`` requires, which workers get a KV transfer backend,
and the worker services of ``docker-compose.yml`` (a test holds the file to the table).
Adding a mode is adding a row.

A stage marked ``optional`` may be left out of a request's chain, as Dynamo degrades: when
its pool has no live worker, when the work it would take off the next stage is too small
to be worth a transfer (a prompt whose uncached part is shorter than
``disagg_min_prompt_tokens``, or a request of ``n > 1`` choices, which fork from one
prefill on their decoding worker), or, for an encode stage, when the request has no image. The
next stage then runs the task :data:`MERGED` names for the pair, doing both stages' work
on one worker (a worker that gets images and no embeddings encodes them itself).

The multimodal modes, as Dynamo names them (E encode, P prefill, D decode; a slash
separates what runs on different workers)::

    agg    EPD    generate                       one worker encodes, prefills, decodes
    e-pd   E/PD   encode -> generate             embeddings encode -> PD worker
    e-p-d  E/P/D  encode -> prefill -> decode    embeddings encode -> P; KV P -> D
    ep-d   EP/D   prefill -> decode              the prefill worker encodes; KV P -> D

``disagg`` is ``ep-d``'s name from before images (text prefill/decode).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stage:
    task: str  # the Celery task (tasks.stages): generate | prefill | decode
    pool: str  # the worker pool it runs on
    optional: bool = False  # the chain may leave it out (see the module's docstring)
    kv_transfer: bool = False  # hands KV to the next stage or takes it from the last
    encodes: bool = False  # runs the vision encoder and hands the embeddings on


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    stages: tuple[Stage, ...]
    summary: str

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools the mode's workers form, in chain order."""
        return tuple(dict.fromkeys(s.pool for s in self.stages))

    @property
    def required_pools(self) -> tuple[str, ...]:
        """Pools without which the mode cannot serve at all."""
        return tuple(dict.fromkeys(s.pool for s in self.stages if not s.optional))

    def moves_kv(self, pool: str) -> bool:
        """Whether ``pool``'s workers need a KV transfer backend in this mode."""
        return any(s.kv_transfer for s in self.stages if s.pool == pool)

    def encodes(self, pool: str) -> bool:
        """Whether ``pool``'s workers are encoders (vision tower only, no text engine)."""
        return any(s.encodes for s in self.stages if s.pool == pool)


# (the optional stage left out, the stage after it) -> the task the latter runs instead
MERGED: dict[tuple[str, str], str] = {
    ("prefill", "decode"): "generate",  # the decode worker prefills the prompt itself
    ("encode", "generate"): "generate",  # the PD worker encodes the images itself
    ("encode", "prefill"): "prefill",  # the prefill worker encodes the images itself
}

_ENCODE = Stage("encode", "encode", optional=True, encodes=True)
_PREFILL = Stage("prefill", "prefill", optional=True, kv_transfer=True)
_DECODE = Stage("decode", "decode", kv_transfer=True)

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("agg", (Stage("generate", "generate"),),
             "EPD: one worker encodes, prefills and decodes each request"),
        Mode("e-pd", (_ENCODE, Stage("generate", "generate")),
             "E/PD: encode workers run the vision tower; a PD worker prefills and decodes"),
        Mode("e-p-d", (_ENCODE, _PREFILL, _DECODE),
             "E/P/D: encode, prefill and decode workers; embeddings E->P, KV P->D"),
        Mode("ep-d", (_PREFILL, _DECODE),
             "EP/D: prefill workers encode and prefill, then hand the KV to decode workers"),
    )
}  # fmt: skip
ALIASES = {"disagg": "ep-d"}  # names kept for the modes they meant before images

ALL_POOLS: tuple[str, ...] = tuple(sorted({p for m in MODES.values() for p in m.pools}))
MODE_NAMES: tuple[str, ...] = (*MODES, *ALIASES)  # what --mode and CONVEYOR_MODE accept


def get_mode(name: str) -> Mode:
    try:
        return MODES[ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODE_NAMES)}") from None


def merged(skipped: str, nxt: str) -> str:
    """The task that does the work of ``skipped`` and ``nxt`` on one worker."""
    try:
        return MERGED[(skipped, nxt)]
    except KeyError:
        raise AssertionError(f"the stage table has no merge of {skipped} into {nxt}") from None
