"""Where a planner's decisions go: a connector per orchestrator.

A connector is told how many workers a pool should have (:class:`Decision`) and acts on
it; the planner holds its next action on that pool until the connector says the action
took effect (:meth:`Connector.settled`) and the pool's live members reached the number.
Scaling down always drains: the worker gets SIGTERM and finishes what it holds.

Connectors: ``advisory`` (log and /metrics only), ``virtual`` (a decision hash in Redis
that an outside orchestrator acknowledges), ``compose`` (the Docker Engine API on its unix
socket), ``kubernetes`` (a Deployment's scale subresource); ``serve`` lives in
``tasks.planner_serve``. The Kubernetes connector is tested against a fake API server in
unit tests only (tests/unit/planner), never against a real cluster; the compose one
against a fake daemon there, and against a real one in tests/compose.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx
import redis

from cluster.keys import planner_decision_key
from cluster.resp import as_str

log = logging.getLogger(__name__)


class ConnectorError(RuntimeError):
    """A connector could not act; its message is one line saying why."""


@dataclass(slots=True)
class Decision:
    """One scaling action: ``pool`` should have ``replicas`` workers."""

    pool: str
    replicas: int
    previous: int
    reason: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Connector(Protocol):
    name: str

    def replicas(self, pool: str) -> int | None:
        """Workers the orchestrator runs or is starting for ``pool`` now; ``None`` when it
        cannot tell (the planner counts the pool's live members instead)."""
        ...

    def scale(self, decision: Decision) -> None:
        """Ask for ``decision.replicas`` workers of ``decision.pool``; returns at once.
        Raises :class:`ConnectorError` when it cannot."""
        ...

    def settled(self, decision: Decision) -> bool:
        """Whether the action took effect, as far as the orchestrator knows."""
        ...


# --------------------------------------------------------------------------- construction


@dataclass(slots=True)
class ConnectorOptions:
    """What the connectors need beyond Redis: one field per ``CONVEYOR_PLANNER_*`` setting
    (``compose_services`` is ``CONVEYOR_PLANNER_COMPOSE_SERVICES``, ...). Unset Kubernetes
    fields take the in-cluster service account's values; an unset ``docker_host`` is
    ``DOCKER_HOST`` or ``/var/run/docker.sock``."""

    compose_services: dict[str, str] = field(default_factory=dict)  # pool -> service
    compose_project: str | None = None
    docker_host: str | None = None  # unix:///path or a socket path
    k8s_api: str | None = None
    k8s_namespace: str | None = None
    k8s_token_file: str | None = None
    k8s_ca_file: str | None = None
    k8s_deployments: dict[str, str] = field(default_factory=dict)  # pool -> deployment
    k8s_verify: bool = True


CONNECTOR_KINDS = ("advisory", "virtual", "compose", "kubernetes", "serve")


def parse_pool_map(text: str, setting: str = "the pool map") -> dict[str, str]:
    """``"generate=worker,decode=dec"`` -> ``{"generate": "worker", "decode": "dec"}``;
    blanks around names are dropped, an empty text is an empty map. ``setting`` names the
    setting in the error."""
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        pool, eq, name = (s.strip() for s in part.partition("="))
        if not eq or not pool or not name:
            raise ValueError(f"{setting}: {part.strip()!r} is not POOL=NAME")
        if pool in out:
            raise ValueError(f"{setting}: pool {pool!r} is mapped twice")
        out[pool] = name
    return out


def build_connector(kind: str, client: redis.Redis, options: ConnectorOptions) -> Connector:
    """The connector ``kind`` (``CONVEYOR_PLANNER_CONNECTOR``) built from ``options``.
    ``serve`` is built by ``conveyor serve --planner``, which owns the worker processes."""
    if kind == "advisory":
        return AdvisoryConnector()
    if kind == "virtual":
        return VirtualConnector(client)
    if kind == "compose":
        if not options.compose_services:
            raise ValueError(
                "the compose connector needs CONVEYOR_PLANNER_COMPOSE_SERVICES "
                "(POOL=SERVICE,...), e.g. generate=worker-generate"
            )
        return ComposeConnector(
            options.compose_services,
            project=options.compose_project,
            socket_path=docker_socket(options.docker_host or os.environ.get("DOCKER_HOST")),
        )
    if kind == "kubernetes":
        if not options.k8s_deployments:
            raise ValueError(
                "the kubernetes connector needs CONVEYOR_PLANNER_K8S_DEPLOYMENTS "
                "(POOL=DEPLOYMENT,...), e.g. generate=conveyor-worker"
            )
        return KubernetesConnector(
            options.k8s_deployments,
            api=options.k8s_api or in_cluster_api(),
            namespace=options.k8s_namespace,
            token_file=options.k8s_token_file or f"{SERVICE_ACCOUNT}/token",
            ca_file=options.k8s_ca_file,
            verify=options.k8s_verify,
        )
    if kind == "serve":
        raise ValueError(
            "the serve connector is built by `conveyor serve --planner`, not by "
            "`conveyor planner` (it owns the worker processes)"
        )
    raise ValueError(
        f"CONVEYOR_PLANNER_CONNECTOR (--connector) {kind!r} is not one of "
        + ", ".join(CONNECTOR_KINDS)
    )


def _mapped(names: dict[str, str], pool: str, setting: str, what: str) -> str:
    """The orchestrator's name for ``pool``; a pool without one is a setting to fix."""
    try:
        return names[pool]
    except KeyError:
        raise ConnectorError(
            f"pool {pool!r} has no {what}: add {pool}=NAME to {setting} "
            f"(mapped: {', '.join(sorted(names)) or 'none'})"
        ) from None


# --------------------------------------------------------------------------- advisory


class AdvisoryConnector:
    """Acts on nothing: logs each decision in one line and keeps the last one per pool
    (for /metrics). Settled at once; it cannot tell replicas."""

    name = "advisory"

    def __init__(self) -> None:
        self.last: dict[str, Decision] = {}

    def replicas(self, pool: str) -> int | None:
        return None

    def scale(self, decision: Decision) -> None:
        self.last[decision.pool] = decision
        log.info(
            "planner (advisory): %s %d -> %d workers: %s [%s]",
            decision.pool, decision.previous, decision.replicas, decision.reason, decision.id,
        )  # fmt: skip

    def settled(self, decision: Decision) -> bool:
        return True


# --------------------------------------------------------------------------- virtual

# set ack (and error) only when the hash still holds that decision: an ack for a decision
# the planner has since replaced is refused rather than taken for the new one
_ACK_LUA = """
local id = redis.call('HGET', KEYS[1], 'id')
if id ~= ARGV[1] then return id or false end
redis.call('HSET', KEYS[1], 'ack', ARGV[1])
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], 'error')
else redis.call('HSET', KEYS[1], 'error', ARGV[2]) end
return true
"""


class VirtualConnector:
    """For any other orchestrator: each decision is written to the Redis hash
    ``planner_decision_key(pool)`` (id, pool, replicas, previous, reason, ts; no TTL),
    replacing the previous one. The orchestrator acts, then sets ``ack`` to the id (and
    ``error`` if it failed: :func:`ack_decision`, ``conveyor planner-ack POOL ID``); the
    action is settled once ``ack`` is the decision's id."""

    name = "virtual"

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._errors_logged: set[str] = set()

    def _fields(self, pool: str) -> dict[str, str]:
        raw = self.client.hgetall(planner_decision_key(pool))
        return {as_str(k): as_str(v) for k, v in raw.items()}

    def replicas(self, pool: str) -> int | None:
        """The last acknowledged decision's replicas, if it was acted on without error;
        otherwise ``None`` (the planner counts the pool's live members)."""
        f = self._fields(pool)
        if f.get("id") and f.get("ack") == f["id"] and "error" not in f:
            return int(f["replicas"])
        return None

    def scale(self, decision: Decision) -> None:
        key = planner_decision_key(decision.pool)
        fields: dict[Any, Any] = {k: str(v) for k, v in decision.to_json().items()}
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)  # the previous decision's ack and error go with it
            pipe.hset(key, mapping=fields)
            pipe.execute()
        except redis.RedisError as e:
            raise ConnectorError(f"cannot write the decision to Redis: {e}") from e

    def settled(self, decision: Decision) -> bool:
        f = self._fields(decision.pool)
        if f.get("ack") != decision.id:
            return False
        if "error" in f and decision.id not in self._errors_logged:
            self._errors_logged.add(decision.id)
            log.warning(
                "planner (virtual): the orchestrator acknowledged %s (%s -> %d) with an "
                "error: %s", decision.id, decision.pool, decision.replicas, f["error"],
            )  # fmt: skip
        return True


def ack_decision(
    client: redis.Redis, pool: str, decision_id: str, error: str | None = None
) -> None:
    """Acknowledge decision ``decision_id`` of ``pool`` (an orchestrator acted on it;
    ``error`` says why it failed, if it did). Raises :class:`ConnectorError` when the pool's
    current decision is another one (or there is none)."""
    current = client.eval(_ACK_LUA, 1, planner_decision_key(pool), decision_id, error or "")
    if current != 1:
        held = as_str(current) if current else "none"
        raise ConnectorError(
            f"pool {pool!r} has no decision {decision_id} to acknowledge (its current: {held})"
        )


# --------------------------------------------------------------------------- compose

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"
# the container config a clone takes over (the rest, Hostname first, is the daemon's own)
_CLONED_CONFIG = ("Env", "Cmd", "Entrypoint", "Healthcheck", "User", "WorkingDir",
                  "StopSignal", "StopTimeout", "ExposedPorts", "Volumes", "Tty", "OpenStdin",
                  "Domainname", "Shell")  # fmt: skip
# an endpoint's settings a clone takes over (not its addresses: each container has its own)
_CLONED_ENDPOINT = ("Links", "DriverOpts")


def docker_socket(docker_host: str | None) -> str:
    """The daemon's unix socket path from ``unix:///path``, a path, or ``None`` (the
    default); other transports are refused."""
    if not docker_host:
        return DEFAULT_DOCKER_SOCKET
    if docker_host.startswith("unix://"):
        return docker_host.removeprefix("unix://")
    if docker_host.startswith("/"):
        return docker_host
    raise ValueError(
        f"CONVEYOR_PLANNER_DOCKER_HOST / DOCKER_HOST {docker_host!r}: the compose connector "
        "talks to the daemon over its unix socket only (unix:///path)"
    )


class ComposeConnector:
    """Scales Docker Compose services through the Docker Engine API on its unix socket, as
    ``docker compose up --scale`` would, without the compose file: a pool is a service of
    ``project`` (from ``compose_project``, or else the compose labels of the container the
    planner runs in). Scaling up clones the service's newest container (image, config,
    labels with the next container number, host config, networks and aliases) as
    ``<project>-<service>-<n>`` and starts it; scaling down stops the newest with its stop
    grace (SIGTERM first: the worker drains, SIGKILL only after the grace) in the
    background, then removes it, except the service's last container, which stays
    (stopped) for the next scale-up to start."""

    name = "compose"

    def __init__(
        self,
        services: dict[str, str],
        project: str | None = None,
        socket_path: str = DEFAULT_DOCKER_SOCKET,
        api_version: str | None = None,
        own_container: str | None = None,
        stop_timeout_s: int | None = None,
    ) -> None:
        self.services = services
        self.socket_path = socket_path
        self.prefix = f"/v{api_version}" if api_version else ""
        self.stop_timeout_s = stop_timeout_s  # None: each container's own StopTimeout
        self.http = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path), base_url="http://docker",
            timeout=httpx.Timeout(30.0),
        )  # fmt: skip
        self._lock = threading.Lock()
        # containers this connector is stopping (draining): id -> its stop thread
        self._stopping: dict[str, threading.Thread] = {}
        self.project = project or self._own_project(own_container or socket.gethostname())

    def close(self) -> None:
        self.http.close()

    # -- the daemon

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        """One request; the daemon's error (JSON ``message``) becomes a ConnectorError."""
        try:
            r = self.http.request(method, self.prefix + path, **kw)
        except httpx.HTTPError as e:
            raise ConnectorError(
                f"cannot reach the Docker daemon at {self.socket_path}: {e}"
            ) from e
        if r.status_code >= 400:
            try:
                msg = r.json().get("message") or r.text
            except ValueError:
                msg = r.text
            raise ConnectorError(f"docker {method} {path}: {r.status_code} {msg.strip()}")
        if r.status_code in (204, 304) or not r.content:
            return None
        return r.json()

    def _own_project(self, container: str) -> str:
        try:
            info = self._call("GET", f"/containers/{container}/json")
        except ConnectorError as e:
            raise ConnectorError(
                "no compose project: set CONVEYOR_PLANNER_COMPOSE_PROJECT, or run the "
                f"planner in a container of the project ({e})"
            ) from e
        project = ((info.get("Config") or {}).get("Labels") or {}).get(PROJECT_LABEL)
        if not project:
            raise ConnectorError(
                "no compose project: set CONVEYOR_PLANNER_COMPOSE_PROJECT; container "
                f"{container} has no {PROJECT_LABEL} label"
            )
        return str(project)

    def _containers(self, service: str) -> list[dict[str, Any]]:
        """The service's containers, running or not (one-off `run` containers aside),
        oldest number first."""
        labels = [f"{PROJECT_LABEL}={self.project}", f"{SERVICE_LABEL}={service}",
                  f"{ONEOFF_LABEL}=False"]  # fmt: skip
        found = self._call(
            "GET", "/containers/json",
            params={"all": "true", "filters": json.dumps({"label": labels})},
        )  # fmt: skip
        return sorted(found or [], key=_number)

    def _service(self, pool: str) -> str:
        return _mapped(self.services, pool, "CONVEYOR_PLANNER_COMPOSE_SERVICES", "compose service")

    def _draining(self) -> set[str]:
        with self._lock:
            for cid in [c for c, t in self._stopping.items() if not t.is_alive()]:
                del self._stopping[cid]
            return set(self._stopping)

    def _running(self, service: str) -> list[dict[str, Any]]:
        """The service's containers that run (or restart) and are not being stopped."""
        draining = self._draining()
        live = ("running", "restarting")
        return [
            c
            for c in self._containers(service)
            if c.get("State") in live and c["Id"] not in draining
        ]

    # -- the protocol

    def replicas(self, pool: str) -> int | None:
        return len(self._running(self._service(pool)))

    def scale(self, decision: Decision) -> None:
        service = self._service(decision.pool)
        running = self._running(service)
        if decision.replicas > len(running):
            self._scale_up(service, decision.replicas - len(running))
        elif decision.replicas < len(running):
            # the newest first; going to 0, the oldest stays (stopped) as the next clone's
            # source: a service with no container is out of the connector's reach
            for c in running[decision.replicas :][::-1]:
                self._stop_in_background(c, remove=decision.replicas > 0 or c is not running[0])

    def settled(self, decision: Decision) -> bool:
        service = self._service(decision.pool)
        ids = {c["Id"] for c in self._containers(service)}
        if ids & self._draining():
            return False  # a worker is still draining
        return len(self._running(service)) == decision.replicas

    # -- scaling

    def _scale_up(self, service: str, count: int) -> None:
        containers = self._containers(service)
        draining = self._draining()
        # stopped containers of the service (the last one a scale-down kept) start first
        for c in containers:
            if count and c.get("State") in ("created", "exited") and c["Id"] not in draining:
                self._call("POST", f"/containers/{c['Id']}/start")
                count -= 1
        if not count:
            return
        if not containers:
            raise ConnectorError(
                f"compose service {service!r} of project {self.project!r} has no container "
                "to clone: start one first (docker compose up -d)"
            )
        source = self._call("GET", f"/containers/{containers[-1]['Id']}/json")
        number = max(_number(c) for c in containers)
        for _ in range(count):
            number += 1
            self._start_clone(source, service, number)

    def _start_clone(self, source: dict[str, Any], service: str, number: int) -> str:
        """Create and start a copy of ``source`` numbered ``number``; its id."""
        name = f"{self.project}-{service}-{number}"
        body, extra_networks = clone_body(source, number, name)
        created = self._call("POST", "/containers/create", params={"name": name}, json=body)
        cid = str(created["Id"])
        # API < 1.44 attaches one network at create: the others before the start
        for net, endpoint in extra_networks.items():
            self._call("POST", f"/networks/{net}/connect",
                       json={"Container": cid, "EndpointConfig": endpoint})  # fmt: skip
        self._call("POST", f"/containers/{cid}/start")
        log.info("planner (compose): started %s (%s)", name, cid[:12])
        return cid

    def _stop_in_background(self, container: dict[str, Any], remove: bool) -> None:
        """Stop (SIGTERM, SIGKILL after the grace) and then remove ``container``, in a
        thread: a worker's drain takes up to its grace, and scale() returns at once."""
        cid = container["Id"]
        name = (container.get("Names") or [cid[:12]])[0].lstrip("/")

        def run() -> None:
            try:
                # SIGTERM, then SIGKILL after the grace: the connector's, else the
                # container's own (compose's stop_grace_period)
                grace = self.stop_timeout_s
                if grace is None:
                    grace = _stop_timeout(self._call("GET", f"/containers/{cid}/json"))
                self._call("POST", f"/containers/{cid}/stop", params={"t": str(grace)},
                           timeout=httpx.Timeout(grace + 30.0))  # fmt: skip
                if remove:
                    self._call("DELETE", f"/containers/{cid}")
                log.info("planner (compose): stopped%s %s", " and removed" if remove else "", name)
            except ConnectorError as e:
                log.error("planner (compose): scaling down %s failed: %s", name, e)

        t = threading.Thread(target=run, name=f"planner-stop-{name}", daemon=True)
        with self._lock:
            self._stopping[cid] = t
        t.start()

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for the background stops (tests; a planner shutting down)."""
        with self._lock:
            threads = list(self._stopping.values())
        for t in threads:
            t.join(timeout)


def _number(container: dict[str, Any]) -> int:
    """A container's compose number (0 when it has none)."""
    labels = container.get("Labels") or (container.get("Config") or {}).get("Labels") or {}
    try:
        return int(labels.get(NUMBER_LABEL, 0))
    except ValueError:
        return 0


def _stop_timeout(info: dict[str, Any]) -> int:
    """The seconds the daemon waits after SIGTERM before SIGKILL: the container's own
    StopTimeout (compose's stop_grace_period), else Docker's default 10."""
    value = (info.get("Config") or {}).get("StopTimeout")
    return int(value) if value is not None else 10


def clone_body(
    source: dict[str, Any], number: int, name: str
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The create body of a clone of ``source`` (an inspect reply) numbered ``number``
    and named ``name``, and the networks to connect it to after the create (name ->
    endpoint config). The host config is taken whole (mounts, network mode, restart
    policy, resources, devices); each network's aliases less the source's own names."""
    config = source.get("Config") or {}
    body: dict[str, Any] = {k: config[k] for k in _CLONED_CONFIG if config.get(k) is not None}
    body["Image"] = config.get("Image") or source["Image"]
    body["Labels"] = {**(config.get("Labels") or {}), NUMBER_LABEL: str(number)}
    host = dict(source.get("HostConfig") or {})
    body["HostConfig"] = host
    # the source's own names are not the clone's: its short id, name and hostname
    own = {source.get("Id", "")[:12], source.get("Name", "").lstrip("/"), config.get("Hostname")}
    endpoints: dict[str, dict[str, Any]] = {}
    for net, settings in ((source.get("NetworkSettings") or {}).get("Networks") or {}).items():
        endpoint = {k: settings[k] for k in _CLONED_ENDPOINT if settings.get(k)}
        aliases = [a for a in settings.get("Aliases") or [] if a not in own]
        if aliases:
            endpoint["Aliases"] = aliases
        endpoints[net] = endpoint
    mode = host.get("NetworkMode") or ""
    first = mode if mode in endpoints else next(iter(endpoints), None)
    if first is not None:
        body["NetworkingConfig"] = {"EndpointsConfig": {first: endpoints.pop(first)}}
    return body, endpoints


# --------------------------------------------------------------------------- kubernetes

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_cluster_api() -> str | None:
    """The API server's URL inside a pod (Kubernetes' own variables), else ``None``."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        return None
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class KubernetesConnector:
    """Sets a Deployment's replicas through its scale subresource (a merge patch of
    ``spec.replicas``); Kubernetes then starts pods, or stops them with SIGTERM and their
    ``terminationGracePeriodSeconds`` (the worker drains). Settled once the Deployment's
    controller caught up (``observedGeneration``) and ``readyReplicas`` equals
    ``spec.replicas`` equals the decision's. Defaults to the pod's service account (token
    re-read on each call: it rotates; CA and namespace from the same folder).

    Tested against a fake API server in unit tests only (tests/unit/planner), never
    against a real cluster."""

    name = "kubernetes"

    def __init__(
        self,
        deployments: dict[str, str],
        api: str | None,
        namespace: str | None = None,
        token_file: str | None = f"{SERVICE_ACCOUNT}/token",
        ca_file: str | None = None,
        verify: bool = True,
        timeout_s: float = 10.0,
    ) -> None:
        if not api:
            raise ConnectorError(
                "no Kubernetes API: set CONVEYOR_PLANNER_K8S_API, or run the "
                "planner in a pod (KUBERNETES_SERVICE_HOST)"
            )
        self.deployments = deployments
        self.token_file = token_file
        self.namespace = namespace or self._read(f"{SERVICE_ACCOUNT}/namespace", "namespace")
        tls: ssl.SSLContext | bool = verify
        if verify:
            # the given CA, else the service account's, else the system's
            in_pod = f"{SERVICE_ACCOUNT}/ca.crt"
            tls = ssl.create_default_context(
                cafile=ca_file or (in_pod if os.path.exists(in_pod) else None)
            )
        self.http = httpx.Client(base_url=api.rstrip("/"), verify=tls, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _read(self, path: str, what: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            setting = {
                "namespace": "CONVEYOR_PLANNER_K8S_NAMESPACE",
                "token": "CONVEYOR_PLANNER_K8S_TOKEN_FILE",
            }[what]
            raise ConnectorError(
                f"no Kubernetes {what}: cannot read {path} ({e}); set {setting}"
            ) from e

    def _path(self, pool: str, scale: bool = False) -> str:
        name = _mapped(self.deployments, pool, "CONVEYOR_PLANNER_K8S_DEPLOYMENTS", "deployment")
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}"
        return path + "/scale" if scale else path

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        headers = {"Accept": "application/json", **kw.pop("headers", {})}
        if self.token_file:
            headers["Authorization"] = "Bearer " + self._read(self.token_file, "token")
        try:
            r = self.http.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as e:
            raise ConnectorError(
                f"cannot reach the Kubernetes API at {self.http.base_url}: {e}"
            ) from e
        try:
            body = r.json()
        except ValueError:
            body = {"message": r.text.strip()}
        if r.status_code >= 400:
            msg = body.get("message") or r.reason_phrase
            raise ConnectorError(f"kubernetes {method} {path}: {r.status_code} {msg}")
        return body

    def replicas(self, pool: str) -> int | None:
        scale = self._call("GET", self._path(pool, scale=True))
        return int((scale.get("spec") or {}).get("replicas") or 0)

    def scale(self, decision: Decision) -> None:
        self._call(
            "PATCH", self._path(decision.pool, scale=True),
            headers={"Content-Type": "application/merge-patch+json"},
            content=json.dumps({"spec": {"replicas": decision.replicas}}),
        )  # fmt: skip
        log.info("planner (kubernetes): %s %d -> %d replicas [%s]", self._path(decision.pool),
                 decision.previous, decision.replicas, decision.id)  # fmt: skip

    def settled(self, decision: Decision) -> bool:
        d = self._call("GET", self._path(decision.pool))
        spec, status = d.get("spec") or {}, d.get("status") or {}
        generation = (d.get("metadata") or {}).get("generation", 0)
        return (
            status.get("observedGeneration", 0) >= generation
            and spec.get("replicas", 1) == decision.replicas
            and status.get("readyReplicas", 0) == decision.replicas  # absent when 0
        )
