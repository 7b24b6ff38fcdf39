"""Build and send a request's chain of stage tasks.

The mode decides the stages (``agg``: one ``generate`` task); the router has already picked
a worker per stage, so each signature goes to that worker's own queue. Later modes add
stages here (prefill -> decode, encode -> ...), each carrying the previous stage's handle.
"""

from __future__ import annotations

from celery import chain
from celery.canvas import Signature

from tasks.app import queue
from tasks.payloads import GeneratePayload
from tasks.router import Route
from tasks.stages import generate

STAGES_BY_MODE: dict[str, tuple[str, ...]] = {"agg": ("generate",)}


def stages(mode: str) -> tuple[str, ...]:
    try:
        return STAGES_BY_MODE[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(STAGES_BY_MODE)}") from None


def build_chain(mode: str, payload: GeneratePayload, routes: dict[str, Route]) -> Signature:
    """The Celery canvas for one request; ``routes`` maps each stage to its worker."""
    if mode != "agg":
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(STAGES_BY_MODE)}")
    route = routes["generate"]
    sig = generate.si(payload.model_dump()).set(
        queue=queue(route.queue), task_id=payload.request_id
    )
    return chain(sig)
