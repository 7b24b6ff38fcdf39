"""Plan and send a request's chain of stage tasks.

The mode decides the stages, the router picks a worker per stage, and each signature goes
to that worker's own queue:

    agg      generate                 on a generate worker
    disagg   prefill -> decode        the prefill task's handle becomes the decode task's
                                      first argument (Celery chains pass results along)

Disaggregation degrades as Dynamo's does: with no live prefill worker, or a prompt whose
part the chosen decode worker has not cached is shorter than ``disagg_min_prompt_tokens``
(not worth a KV transfer), the request runs aggregated on that decode worker — a decode
worker runs ``generate`` tasks too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from celery import chain
from celery.canvas import Signature

from tasks.app import queue, route_to
from tasks.payloads import GeneratePayload
from tasks.router import PinnedWorkerMissing, Route, Router, RouteRequest
from tasks.settings import POOLS_BY_MODE, Settings
from tasks.stages import decode, generate, prefill


@dataclass(slots=True)
class Plan:
    """Which task runs where, in order; ``fallback`` says why a disagg request runs
    aggregated (``no_prefill_worker`` / ``short_prompt``)."""

    steps: list[tuple[str, Route]]
    fallback: str | None = None

    @property
    def routes(self) -> list[Route]:
        return [r for _, r in self.steps]


class NoLiveWorker(Exception):
    def __init__(self, pool: str) -> None:
        super().__init__(pool)
        self.pool = pool


def stages(mode: str) -> tuple[str, ...]:
    """The worker pools a mode uses."""
    try:
        return POOLS_BY_MODE[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(POOLS_BY_MODE)}") from None


def required_pools(mode: str) -> tuple[str, ...]:
    """Pools without which a mode cannot serve (disagg survives without prefill workers)."""
    return ("decode",) if mode == "disagg" else stages(mode)


async def plan(router: Router, s: Settings, req: RouteRequest) -> Plan:
    """Pick workers for every stage; the picks are counted as load until released.

    A pinned worker id must be a live member of one of the mode's pools; the stage that
    runs on its pool goes to it, the others are routed as usual."""
    picked: list[Route] = []
    pin_used = False

    async def pick(pool: str) -> Route | None:
        nonlocal pin_used
        route = None
        if req.pin and not pin_used:
            try:
                route = await router.pick(pool, req)
                pin_used = route is not None
            except PinnedWorkerMissing:
                route = None
        if route is None:
            route = await router.pick(pool, replace(req, pin=None))
        if route is not None:
            picked.append(route)
        return route

    try:
        if s.mode == "agg":
            route = await pick("generate")
            if route is None:
                raise NoLiveWorker("generate")
            result = Plan([("generate", route)])
        else:
            stages(s.mode)  # validates
            dec = await pick("decode")
            if dec is None:
                raise NoLiveWorker("decode")
            pin_pending = bool(req.pin) and not pin_used  # the pin names a prefill worker
            uncached = req.prompt_len - dec.overlap_blocks * s.block_size
            if uncached < s.disagg_min_prompt_tokens and not pin_pending:
                result = Plan([("generate", dec)], fallback="short_prompt")
            else:
                pre = await pick("prefill")
                if pre is None:
                    result = Plan([("generate", dec)], fallback="no_prefill_worker")
                else:
                    pre.blocks = 0  # a prefill worker holds the KV only until it is pulled
                    result = Plan([("prefill", pre), ("decode", dec)])
        if req.pin and not pin_used:
            raise PinnedWorkerMissing(req.pin)
    except BaseException:
        await router.release(*picked)
        raise
    return result


def build_chain(p: Plan, payload: GeneratePayload) -> Signature:
    """The Celery canvas for one request."""
    body = payload.model_dump()
    tasks = {"generate": generate, "prefill": prefill, "decode": decode}
    # What task events, Flower and the worker's log show for the arguments: the request,
    # not the prompt's token ids (Celery would repr them all for every message it sends)
    shown = dict(argsrepr=f"({payload.request_id}: {len(payload.prompt_token_ids)} prompt "
                          "tokens)", kwargsrepr="{}")  # fmt: skip
    sigs = []
    for i, (name, route) in enumerate(p.steps):
        task = tasks[name]
        # the first task gets the payload alone; later ones get the previous handle first.
        # The first is sent from here (a Queue object names the route: the anonymous
        # exchange, straight onto the list); later ones travel inside the message, so they
        # name their queue in plain JSON.
        if i == 0:
            sig = task.si(body).set(queue=queue(route.queue), task_id=payload.request_id,
                                    **shown)  # fmt: skip
        else:
            sig = task.s(body).set(**route_to(route.queue), **shown)
        sigs.append(sig)
    # One stage (aggregated) goes as the task alone: the same message (its embed names no
    # chain rather than an empty one), but Celery's chain deep-copies its tasks (the
    # payload with every token id) to send one: ~390 against ~270 us of the API loop's
    # CPU per request.
    return sigs[0] if len(sigs) == 1 else chain(*sigs)
