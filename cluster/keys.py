"""The names of the cluster's Redis keys and channels: a function each, the only place a
``conveyor:`` name of the control plane is spelled (the data plane's, token channels and
transfer keys, live in :mod:`kvbm.protocol`, on the same prefix)."""

from __future__ import annotations

from dataclasses import dataclass

KEY_PREFIX = "conveyor:"
# PUBLISH worker id: a worker was declared dead (its engine process saw it die), so every
# API checks its waiting streams' workers now rather than at its next liveness poll
WORKER_DEATHS_CHANNEL = KEY_PREFIX + "deaths"
# PUBLISH a JSON list of request ids: vLLM's /abort_requests, heard by every API process,
# each of which aborts the generate requests of those ids it serves (api.routes_generate)
ABORTS_CHANNEL = KEY_PREFIX + "abort-requests"
# PUBLISH a JSON command ({"id", "op", ...}) to every engine process (reset_prefix_cache,
# pause, resume); each answers in the HASH control_reply_key(id), field its worker id
CONTROL_CHANNEL = KEY_PREFIX + "control"
# STRING, JSON {"mode", "clear_cache", "at"}: the deployment is paused (vLLM's /pause) until
# /resume deletes it; an engine process that missed the command, or starts meanwhile,
# pauses when it reads it (workers.engine_proc, every PAUSE_SYNC_S)
PAUSED_KEY = KEY_PREFIX + "paused"


def control_reply_key(command_id: str) -> str:
    """HASH worker id -> its answer (JSON) to the control command ``command_id``."""
    return f"{KEY_PREFIX}control:{command_id}"


def session_key(session_id: str) -> str:
    """HASH stage (prefill, decode) -> worker id: where Dynamo's ``nvext.session_control``
    session ran its last turn (its next turns go there while it lives), expiring after the
    session's timeout without a turn (:mod:`api.nvext`)."""
    return f"{KEY_PREFIX}session:{session_id}"


def worker_key(pool: str, worker_id: str) -> str:
    """STRING: the worker's last heartbeat report (JSON), expiring with its TTL."""
    return f"{KEY_PREFIX}worker:{pool}:{worker_id}"


def alive_key(pool: str) -> str:
    """ZSET worker id -> heartbeat expiry (ms, Redis's clock): the pool's members."""
    return f"{KEY_PREFIX}alive:{pool}"


def queue_owners_key(pool: str) -> str:
    """SET of the worker ids whose own queue may hold messages: every heartbeat adds its
    worker; a reader of queue depths retires a worker once it is dead and its queue empty
    (so a departed worker's stranded messages stay in view until they are gone)."""
    return f"{KEY_PREFIX}queue-owners:{pool}"


def load_key(pool: str) -> str:
    """HASH ``<worker id>:<field>`` -> the load the routers counted (:mod:`cluster.ledger`)."""
    return f"{KEY_PREFIX}load:{pool}"


def load_owner_key(pool: str, router_id: str) -> str:
    """HASH, the fields of :func:`load_key`: the part of the pool's load one router (one
    API process) counted, so that another can give it back if that process dies."""
    return f"{KEY_PREFIX}loadby:{pool}:{router_id}"


def load_owners_key(pool: str) -> str:
    """ZSET router id -> the expiry (ms, Redis's clock) of its lease on its counted load,
    renewed while it runs; a lapsed lease's counts are given back by the other routers."""
    return f"{KEY_PREFIX}loadowners:{pool}"


def lora_registry_key() -> str:
    """HASH adapter name -> JSON ``{"path": ...}``: the LoRA adapters every API replica
    serves (:mod:`cluster.lora`)."""
    return f"{KEY_PREFIX}lora-adapters"


def traffic_key(bucket: int) -> str:
    """HASH: the API processes' traffic counts of one time bucket (:mod:`cluster.traffic`;
    ``bucket`` = unix time // its BUCKET_S), expiring an hour on."""
    return f"{KEY_PREFIX}traffic:{bucket}"


def planner_decision_key(pool: str) -> str:
    """HASH: the planner's latest scaling decision for the pool (id, pool, replicas,
    previous, reason, ts) and an orchestrator's ``ack`` / ``error`` of it."""
    return f"{KEY_PREFIX}planner:decision:{pool}"


def planner_state_key() -> str:
    """HASH: the planner's own state (what it keeps across a restart)."""
    return f"{KEY_PREFIX}planner:state"


@dataclass(frozen=True, slots=True)
class IndexKeys:
    """One pool's KV-block index in Redis (see :mod:`cluster.index`)."""

    events: str  # STREAM of event batches (workers') and decisions (approximate routers')
    worker_blocks: str  # + worker id: SET of hex hashes the worker holds in G1 (snapshot)
    seq: str  # + worker id: the number of its last applied event batch
    host_blocks: str  # + worker id: SET of hex hashes the worker holds in G2
    disk_blocks: str  # + worker id: SET of hex hashes the worker holds in G3

    def tier_blocks(self, tier: int) -> str:
        """The prefix (+ worker id) of the SET of blocks a worker holds in ``tier`` (1, 2,
        3: kvbm.protocol's G1, G2, G3)."""
        return (self.worker_blocks, self.host_blocks, self.disk_blocks)[tier - 1]


def index_keys(pool: str) -> IndexKeys:
    return IndexKeys(
        f"{KEY_PREFIX}kvev:{pool}", f"{KEY_PREFIX}kvw:{pool}:", f"{KEY_PREFIX}kvseq:{pool}:",
        f"{KEY_PREFIX}kvw2:{pool}:", f"{KEY_PREFIX}kvw3:{pool}:",
    )  # fmt: skip
