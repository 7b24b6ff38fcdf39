"""Fake orchestrators for the connectors' unit tests: a Docker daemon on a unix socket and a
Kubernetes API server on 127.0.0.1, each an http.server in a thread that keeps its objects
in a dict and answers only the endpoints the connectors use (bodies shaped as the Docker
Engine API's and Kubernetes' documentation give them). Unit tests only: the compose
connector also runs against a real daemon in tests/compose; the Kubernetes one never runs
against a real cluster."""

from __future__ import annotations

import json
import re
import socketserver
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

VERSION_PREFIX = re.compile(r"^/v1\.\d+(?=/)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx speaks it
    app: Any  # set on the subclass: an object with handle(method, path, query, body, headers)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a unix socket has no client address to log

    def _any(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        status, reply = self.app.handle(self.command, url.path, query, body, self.headers)
        data = b"" if reply is None else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PATCH = _any


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:
        sock, _ = super().get_request()
        return sock, ("local", 0)  # BaseHTTPRequestHandler wants an address pair


# ---------------------------------------------------------------------------- Docker


def container(
    project: str, service: str, number: int, *, state: str = "running", **config: Any
) -> dict[str, Any]:
    """An inspect reply of a compose container (what `docker compose up` creates)."""
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    name = f"{project}-{service}-{number}"
    labels = {
        "com.docker.compose.project": project,
        "com.docker.compose.service": service,
        "com.docker.compose.container-number": str(number),
        "com.docker.compose.oneoff": "False",
        "com.docker.compose.config-hash": "c0ffee",
    }
    net = f"{project}_default"
    return {
        "Id": cid,
        "Name": "/" + name,
        "Image": "sha256:" + "ab" * 32,
        "State": {"Status": state, "Running": state == "running"},
        "Config": {
            "Hostname": cid[:12],
            "Image": "conveyor:latest",
            "Env": ["CONVEYOR_POOL=generate", "CONVEYOR_REDIS_URL=redis://redis:6379/0"],
            "Cmd": ["worker", "--pool", "generate"],
            "Entrypoint": ["conveyor"],
            "Labels": labels,
            "Healthcheck": {"Test": ["CMD", "conveyor", "health"], "Interval": 10**10},
            "User": "conveyor",
            "WorkingDir": "/app",
            "StopSignal": "SIGTERM",
            "StopTimeout": 120,
            **config,
        },
        "HostConfig": {
            "Binds": None,
            "Mounts": [{"Type": "volume", "Source": f"{project}_models", "Target": "/models"}],
            "NetworkMode": net,
            "RestartPolicy": {"Name": "unless-stopped", "MaximumRetryCount": 0},
            "NanoCpus": 2 * 10**9,
            "Memory": 4 << 30,
            "Init": True,
        },
        "NetworkSettings": {
            "Networks": {
                net: {
                    "Aliases": [name, service, cid[:12]],
                    "NetworkID": "n1",
                    "IPAddress": "172.18.0.3",
                    "Links": None,
                },
                f"{project}_backend": {
                    "Aliases": [name, service],
                    "NetworkID": "n2",
                    "IPAddress": "172.19.0.3",
                },
            }
        },
    }


class FakeDocker:
    """A Docker daemon's container endpoints over a unix socket. ``calls`` records every
    request as (method, path without the version prefix, query, body); ``hold_stops``,
    while clear, keeps each stop waiting (a worker draining)."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = str(socket_path)
        self.containers: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []
        self.versions: set[str] = set()
        self.done: list[tuple[str, str, dict[str, str]]] = []  # start/stop/remove
        self.hold_stops = threading.Event()
        self.hold_stops.set()
        self.lock = threading.Lock()

    def add(self, info: dict[str, Any]) -> dict[str, Any]:
        self.containers[info["Id"]] = info
        return info

    def find(self, ref: str) -> dict[str, Any] | None:
        for c in self.containers.values():
            if c["Id"].startswith(ref) or c["Name"] == "/" + ref:
                return c
        return None

    def service(self, project: str, service: str) -> list[dict[str, Any]]:
        """The service's containers, by number."""
        return sorted(
            (c for c in self.containers.values()
             if c["Config"]["Labels"].get("com.docker.compose.project") == project
             and c["Config"]["Labels"].get("com.docker.compose.service") == service),
            key=lambda c: int(c["Config"]["Labels"]["com.docker.compose.container-number"]),
        )  # fmt: skip

    def names(self, project: str, service: str, state: str | None = None) -> list[str]:
        return [c["Name"].lstrip("/") for c in self.service(project, service)
                if state is None or c["State"]["Status"] == state]  # fmt: skip

    @staticmethod
    def _missing(ref: str) -> tuple[int, dict[str, str]]:
        return 404, {"message": f"No such container: {ref}"}

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Any]:
        m = VERSION_PREFIX.match(path)
        if m:
            self.versions.add(m.group(0))
            path = path[m.end() :]
        with self.lock:
            self.calls.append((method, path, query, body))
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/containers/json":
            return 200, self._list(query)
        if method == "POST" and path == "/containers/create":
            return self._create(query["name"], body)
        if parts[0] == "networks" and parts[-1] == "connect":
            c = self.find(body["Container"])
            if c is None:
                return self._missing(body["Container"])
            c["NetworkSettings"]["Networks"][parts[1]] = dict(body["EndpointConfig"])
            return 200, None
        if parts[0] != "containers" or len(parts) < 2:
            return 404, {"message": "page not found"}
        c = self.find(parts[1])
        if c is None:
            return self._missing(parts[1])
        state, name = c["State"], c["Name"].lstrip("/")
        if method == "GET" and parts[2:] == ["json"]:
            return 200, c
        if method == "POST" and parts[2:] == ["start"]:
            if state["Running"]:
                return 304, None
            state.update(Status="running", Running=True)
            self.done.append(("start", name, query))
            return 204, None
        if method == "POST" and parts[2:] == ["stop"]:
            self.hold_stops.wait(30)
            state.update(Status="exited", Running=False)
            self.done.append(("stop", name, query))
            return 204, None
        if method == "DELETE" and len(parts) == 2:
            if state["Running"]:
                return 409, {
                    "message": f"cannot remove container {c['Name']}: container is running"
                }
            del self.containers[c["Id"]]
            self.done.append(("remove", name, query))
            return 204, None
        return 404, {"message": "page not found"}

    def _list(self, query: dict[str, str]) -> list[dict[str, Any]]:
        wanted = json.loads(query.get("filters", "{}")).get("label", [])
        out = []
        for c in self.containers.values():
            labels = c["Config"]["Labels"]
            if all(labels.get(k) == v for k, _, v in (w.partition("=") for w in wanted)):
                if query.get("all") in ("1", "true") or c["State"]["Running"]:
                    out.append({"Id": c["Id"], "Names": [c["Name"]], "Labels": labels,
                                "State": c["State"]["Status"]})  # fmt: skip
        return out

    def _create(self, name: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self.find(name) is not None:
            return 409, {
                "message": f'Conflict. The container name "/{name}" is already in use by '
                'container "0123". You have to remove (or rename) that container to be '
                "able to reuse that name."
            }
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        config = {k: v for k, v in body.items() if k not in ("HostConfig", "NetworkingConfig")}
        config["Hostname"] = cid[:12]
        endpoints = (body.get("NetworkingConfig") or {}).get("EndpointsConfig") or {}
        self.add({
            "Id": cid, "Name": "/" + name, "Image": "sha256:" + "ab" * 32,
            "State": {"Status": "created", "Running": False}, "Config": config,
            "HostConfig": body.get("HostConfig") or {},
            "NetworkSettings": {"Networks": {k: dict(v) for k, v in endpoints.items()}},
        })  # fmt: skip
        return 201, {"Id": cid, "Warnings": []}

    def creates(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, body) of each create, in order."""
        return [(q["name"], b) for m, p, q, b in self.calls if p == "/containers/create"]

    def actions(self, *kinds: str) -> list[tuple[str, str, dict[str, str]]]:
        """(kind, container name, query) of each start/stop/remove, in order."""
        return [a for a in self.done if a[0] in kinds]


@contextmanager
def _serving(server: socketserver.BaseServer) -> Iterator[None]:
    """``server`` answering in a thread for the block, then closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def fake_docker(tmp_path: Path) -> Iterator[FakeDocker]:
    daemon = FakeDocker(tmp_path / "docker.sock")
    handler = type("DockerHandler", (_Handler,), {"app": daemon})
    try:
        with _serving(_UnixHTTPServer(daemon.socket_path, handler)):
            yield daemon
    finally:
        daemon.hold_stops.set()  # no handler left waiting


# ---------------------------------------------------------------------------- Kubernetes


class FakeKubernetes:
    """The apps/v1 Deployment and its scale subresource, in one namespace. Each request
    must carry ``Bearer <token>`` (the test may change ``token``, as a rotation does);
    a scale patch must be a merge patch of ``spec.replicas``. The controller acts only when
    the test calls :meth:`roll_out`."""

    def __init__(self, namespace: str, token: str) -> None:
        self.namespace = namespace
        self.token = token
        self.deployments: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, str, Any]] = []  # deployment, content type, body
        self.url = ""

    def add(self, name: str, replicas: int) -> None:
        self.deployments[name] = {
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": self.namespace, "generation": 1},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas,
                       **({"readyReplicas": replicas} if replicas else {})},
        }  # fmt: skip

    def roll_out(self, name: str) -> None:
        """The controller catches up: every wanted pod is ready (``readyReplicas`` is left
        out at 0, as the API server leaves it)."""
        d = self.deployments[name]
        n = d["spec"]["replicas"]
        d["status"] = {"observedGeneration": d["metadata"]["generation"], "replicas": n}
        if n:
            d["status"]["readyReplicas"] = n

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                      "message": message, "reason": reason, "code": code}  # fmt: skip

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Any]:
        if headers.get("Authorization") != f"Bearer {self.token}":
            return self._status(401, "Unauthorized", "Unauthorized")
        m = re.fullmatch(r"/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)(/scale)?", path)
        if m is None or m.group(1) != self.namespace:
            return self._status(404, "NotFound", "the server could not find the requested resource")
        name, scale = m.group(2), bool(m.group(3))
        d = self.deployments.get(name)
        if d is None:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        if method == "PATCH" and scale:
            ctype = headers.get("Content-Type")
            self.patches.append((name, ctype, body))
            if ctype != "application/merge-patch+json":
                return self._status(415, "UnsupportedMediaType", f"unsupported: {ctype}")
            replicas = ((body or {}).get("spec") or {}).get("replicas")
            if set(body) != {"spec"} or not isinstance(replicas, int) or replicas < 0:
                return self._status(422, "Invalid", f"invalid scale patch: {body}")
            if replicas != d["spec"]["replicas"]:
                d["spec"]["replicas"] = replicas
                d["metadata"]["generation"] += 1
        elif method not in ("GET", "PATCH"):
            return self._status(405, "MethodNotAllowed", method)
        if scale:
            return 200, {
                "kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": d["metadata"],
                "spec": {"replicas": d["spec"]["replicas"]},
                "status": {"replicas": d["status"].get("replicas", 0)},
            }  # fmt: skip
        return 200, d


@contextmanager
def fake_kubernetes(namespace: str, token: str) -> Iterator[FakeKubernetes]:
    api = FakeKubernetes(namespace, token)
    handler = type("KubeHandler", (_Handler,), {"app": api})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    with _serving(server):
        yield api
