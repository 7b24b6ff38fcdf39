"""Plan and send a request's chain of stage tasks.

The deployment's row of the stage table (:mod:`tasks.modes`) names the stages; the router
picks a worker per stage, and each signature goes to that worker's own queue. A stage's
result is the next one's first argument (Celery chains pass results along): the prefill
task's handle says where the decode task finds the prompt's KV.

Stages are routed last to first: the last stage's worker is where the request ends up, and
what it has cached decides whether an optional stage before it is worth running. An
optional stage is left out, as Dynamo degrades, when its pool has no live worker
(``no_<pool>_worker``) or when it hands KV on and the prompt's part the next worker has
not cached is shorter than ``disagg_min_prompt_tokens`` (``short_prompt``, not worth a
transfer), or when the request asks for ``n > 1`` choices (``n_choices``: they fork from
one prefill on the worker that decodes them, docs/api.md); the next stage then
runs the merged task (:data:`tasks.modes.MERGED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from celery import chain
from celery.canvas import Signature

from kvbm.protocol import StagePayload
from tasks.app import queue, route_to
from tasks.modes import merged
from tasks.router import PinnedWorkerMissing, Route, Router, RouteRequest
from tasks.settings import Settings
from tasks.stages import decode, embed, encode, generate, prefill

TASKS = {"encode": encode, "generate": generate, "prefill": prefill, "decode": decode,
         "embed": embed}  # fmt: skip


@dataclass(slots=True)
class Plan:
    """Which task runs where, in order; ``fallbacks`` say why optional stages were left
    out (``no_<pool>_worker`` / ``short_prompt`` / ``n_choices``)."""

    steps: list[tuple[str, Route]]
    fallbacks: list[str] = field(default_factory=list)

    @property
    def routes(self) -> list[Route]:
        return [r for _, r in self.steps]


class NoLiveWorker(Exception):
    def __init__(self, pool: str) -> None:
        super().__init__(pool)
        self.pool = pool


async def plan(router: Router, s: Settings, req: RouteRequest) -> Plan:
    """Pick workers for every stage; the picks are counted as load until released.

    A pinned worker id must be a live member of one of the mode's pools; the stage that
    runs on its pool goes to it, the others are routed as usual. A prefill pin (P/D) must
    be a live prefill worker, and the prefill stage then runs there whatever its prompt."""
    picked: list[Route] = []
    pin_used = prefill_pinned = False

    async def pick(pool: str, prefill: bool = False) -> Route | None:
        nonlocal pin_used, prefill_pinned
        route = None
        if prefill and req.prefill_pin:  # raises PinnedWorkerMissing if it is not there
            route = await router.pick(pool, replace(req, pin=req.prefill_pin))
            prefill_pinned = route is not None
        elif req.pin and not pin_used:
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

    steps: list[tuple[str, Route]] = []  # filled from the last stage back
    fallbacks: list[str] = []
    try:
        for stage in reversed(s.serving_mode.stages):
            if stage.optional:
                nxt_task, nxt = steps[0]
                uncached = req.prompt_len - nxt.overlap_blocks * s.engine.block_size
                # the pin may name this pool; a prefill pin names the prefill stage's
                pin_pending = (bool(req.pin) and not pin_used) or bool(req.prefill_pin)
                route, why = None, None
                if stage.encodes and not req.images:
                    pass  # nothing to encode: not a fallback
                elif stage.kv_transfer and req.choices > 1:
                    why = "n_choices"
                elif stage.kv_transfer and uncached < s.transfer.disagg_min_prompt_tokens \
                        and not pin_pending:  # fmt: skip
                    why = "short_prompt"
                else:
                    route = await pick(stage.pool, prefill=stage.kv_transfer)
                    why = f"no_{stage.pool}_worker"
                if route is None:
                    steps[0] = (merged(stage.task, nxt_task), nxt)
                    if why is not None:
                        fallbacks.append(why)
                    continue
            else:
                route = await pick(stage.pool)
                if route is None:
                    raise NoLiveWorker(stage.pool)
            if steps:
                route.blocks = 0  # it holds the KV only until the next stage takes it
            steps.insert(0, (stage.task, route))
        if req.pin and not pin_used:
            raise PinnedWorkerMissing(req.pin)
        if req.prefill_pin and not prefill_pinned:
            raise PinnedWorkerMissing(req.prefill_pin)
    except BaseException:
        await router.release(*picked)
        raise
    return Plan(steps, fallbacks)


async def plan_continuation(router: Router, pool: str, req: RouteRequest) -> Plan:
    """Where a stream whose worker died goes on (migration): one ``generate`` task on a
    live worker of that worker's pool, which recomputes the prompt and the tokens so far
    and decodes from there (a decode pool's workers run ``generate`` too: MERGED)."""
    route = await router.pick(pool, req)
    if route is None:
        raise NoLiveWorker(pool)
    return Plan([("generate", route)], [])


async def plan_pooling(router: Router, s: Settings, req: RouteRequest) -> Plan:
    """Where an embedding request runs: one ``embed`` task on a worker of the pool that runs
    whole requests (the mode's last stage: generate, or decode, whose workers run generate
    too), picked by load as any request (its work is a prompt to prefill)."""
    pool = s.serving_mode.stages[-1].pool
    route = await router.pick(pool, req)
    if route is None:
        raise NoLiveWorker(pool)
    return Plan([("embed", route)], [])


def build_chain(p: Plan, payload: StagePayload) -> Signature:
    """The Celery canvas for one request."""
    body = payload.model_dump()
    # What task events, Flower and the worker's log show for the arguments: the request,
    # not the prompt's token ids (Celery would repr them all for every message it sends)
    shown = dict(argsrepr=f"({payload.request_id}: {len(payload.prompt_token_ids)} prompt "
                          "tokens)", kwargsrepr="{}")  # fmt: skip
    sigs = []
    for i, (name, route) in enumerate(p.steps):
        task = TASKS[name]
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
    # One stage (aggregated) goes as the task alone: the same message, without the copy
    # of every task Celery's chain makes to send one (docs/performance.md, "one-stage
    # requests skip the chain").
    return sigs[0] if len(sigs) == 1 else chain(*sigs)
