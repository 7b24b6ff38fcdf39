"""planner.connectors: the advisory connector, the compose connector against a fake Docker
daemon on a unix socket, the Kubernetes connector against a fake API server, and the
connectors' construction. The fakes (tests/unit/planner/fakes.py) are for unit tests
only; the Kubernetes connector is tested against a fake API server only, never against a
real cluster. The virtual connector runs on a real redis-server in
tests/integration/test_planner_virtual.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from planner.connectors import (
    AdvisoryConnector,
    ComposeConnector,
    ConnectorError,
    ConnectorOptions,
    Decision,
    KubernetesConnector,
    VirtualConnector,
    build_connector,
    clone_body,
    docker_socket,
    parse_pool_map,
)
from tests.unit.planner.fakes import (
    FakeDocker,
    FakeKubernetes,
    container,
    fake_docker,
    fake_kubernetes,
)

PROJECT, SERVICE = "proj", "worker-generate"
LABELS = ("com.docker.compose.project", "com.docker.compose.service")


def decision(replicas: int, previous: int, pool: str = "generate") -> Decision:
    return Decision(pool=pool, replicas=replicas, previous=previous, reason="test")


# --------------------------------------------------------------------------- advisory


def test_advisory_logs_one_line_and_keeps_the_last_decision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = AdvisoryConnector()
    first, second = decision(3, 2), decision(4, 3)
    with caplog.at_level(logging.INFO, logger="planner.connectors"):
        c.scale(first)
        c.scale(second)
        c.scale(decision(1, 2, pool="decode"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "generate 3 -> 4 workers: test" in lines[1] and second.id in lines[1]
    assert c.last == {"generate": second, "decode": c.last["decode"]}
    assert c.last["decode"].replicas == 1
    assert c.settled(first) and c.replicas("generate") is None


# --------------------------------------------------------------------------- compose


@pytest.fixture
def docker(tmp_path: Path) -> Iterator[FakeDocker]:
    with fake_docker(tmp_path) as d:
        d.add(container(PROJECT, SERVICE, 1))
        # not the service's: another project's worker, a one-off run, and the planner
        d.add(container("other", SERVICE, 1))
        oneoff = container(PROJECT, SERVICE, 9)
        oneoff["Config"]["Labels"]["com.docker.compose.oneoff"] = "True"
        d.add(oneoff)
        d.add(container(PROJECT, "planner", 1))
        yield d


def compose(docker: FakeDocker, **kw: object) -> ComposeConnector:
    kw.setdefault("project", PROJECT)
    return ComposeConnector({"generate": SERVICE}, socket_path=docker.socket_path, **kw)  # type: ignore[arg-type]


def test_compose_scale_up_clones_the_services_newest_container(docker: FakeDocker) -> None:
    source = docker.service(PROJECT, SERVICE)[0]
    c = compose(docker, api_version="1.41")
    assert c.replicas("generate") == 1
    c.scale(decision(3, 1))
    assert docker.versions == {"/v1.41"}  # every request under the version asked for
    creates = docker.creates()
    assert [name for name, _ in creates] == [f"{PROJECT}-{SERVICE}-2", f"{PROJECT}-{SERVICE}-3"]
    for number, (name, body) in enumerate(creates, start=2):
        config = source["Config"]
        for key in ("Image", "Env", "Cmd", "Entrypoint", "Healthcheck", "User", "WorkingDir",
                    "StopSignal", "StopTimeout"):  # fmt: skip
            assert body[key] == config[key], key
        assert "Hostname" not in body  # the daemon gives each container its own
        assert body["Labels"] == {
            **config["Labels"], "com.docker.compose.container-number": str(number)
        }  # fmt: skip
        assert body["HostConfig"] == source["HostConfig"]
        # the network of the network mode at create, the service's alias without the
        # source's own name and id; the second network connected before the start
        assert body["NetworkingConfig"] == {
            "EndpointsConfig": {f"{PROJECT}_default": {"Aliases": [SERVICE]}}
        }
        clone = docker.find(name)
        assert clone is not None and clone["State"]["Running"]
        assert clone["NetworkSettings"]["Networks"][f"{PROJECT}_backend"] == {"Aliases": [SERVICE]}
    assert [a[:2] for a in docker.actions("start")] == [
        ("start", f"{PROJECT}-{SERVICE}-2"), ("start", f"{PROJECT}-{SERVICE}-3")
    ]  # fmt: skip
    assert c.replicas("generate") == 3 and c.settled(decision(3, 1))
    assert len(docker.service("other", SERVICE)) == 1  # another project's service untouched


def test_compose_scale_down_drains_the_newest_then_removes_it(docker: FakeDocker) -> None:
    c = compose(docker)
    c.scale(decision(3, 1))
    docker.hold_stops.clear()  # the workers take their time to drain
    down = decision(1, 3)
    t0 = time.monotonic()
    c.scale(down)
    assert time.monotonic() - t0 < 5  # returns at once, the stops go on in the background
    # while they drain: not counted, and not settled
    assert c.replicas("generate") == 1
    assert not c.settled(down)
    docker.hold_stops.set()
    c.wait_idle(10)
    assert c.settled(down) and c.replicas("generate") == 1
    newest, second = f"{PROJECT}-{SERVICE}-3", f"{PROJECT}-{SERVICE}-2"
    acts = docker.actions("stop", "remove")
    # each stop (SIGTERM, SIGKILL after the service's StopTimeout) before its remove
    assert acts.index(("stop", newest, {"t": "120"})) < acts.index(("remove", newest, {}))
    assert acts.index(("stop", second, {"t": "120"})) < acts.index(("remove", second, {}))
    assert len(acts) == 4  # the first worker stays
    assert docker.names(PROJECT, SERVICE) == [f"{PROJECT}-{SERVICE}-1", f"{PROJECT}-{SERVICE}-9"]


def test_compose_stop_timeout_option_overrides_the_containers(docker: FakeDocker) -> None:
    c = compose(docker, stop_timeout_s=7)
    c.scale(decision(2, 1))
    c.scale(decision(1, 2))
    c.wait_idle(10)
    assert docker.actions("stop") == [("stop", f"{PROJECT}-{SERVICE}-2", {"t": "7"})]


def test_compose_scale_to_zero_keeps_the_last_container_to_start_again(
    docker: FakeDocker,
) -> None:
    c = compose(docker)
    c.scale(decision(0, 1))
    c.wait_idle(10)
    assert c.replicas("generate") == 0 and c.settled(decision(0, 1))
    first = f"{PROJECT}-{SERVICE}-1"
    assert docker.actions("stop", "remove") == [("stop", first, {"t": "120"})]
    assert docker.names(PROJECT, SERVICE, state="exited") == [first]
    c.scale(decision(2, 0))  # the stopped one starts, one clone joins it
    assert docker.actions("start") == [
        ("start", first, {}),
        ("start", f"{PROJECT}-{SERVICE}-2", {}),
    ]
    assert [n for n, _ in docker.creates()] == [f"{PROJECT}-{SERVICE}-2"]
    assert c.replicas("generate") == 2


def test_compose_finds_its_project_from_its_own_container(docker: FakeDocker) -> None:
    planner = docker.service(PROJECT, "planner")[0]
    c = ComposeConnector(
        {"generate": SERVICE}, socket_path=docker.socket_path, own_container=planner["Id"][:12]
    )
    assert c.project == PROJECT and c.replicas("generate") == 1
    with pytest.raises(ConnectorError, match="CONVEYOR_PLANNER_COMPOSE_PROJECT.*No such container"):
        ComposeConnector({"generate": SERVICE}, socket_path=docker.socket_path,
                         own_container="0123456789ab")  # fmt: skip


def test_compose_errors_carry_the_daemons_message(docker: FakeDocker, tmp_path: Path) -> None:
    c = compose(docker)
    # a container outside the service holds the clone's name: the daemon refuses the create
    squatter = container("elsewhere", "x", 1)
    squatter["Name"] = f"/{PROJECT}-{SERVICE}-2"
    docker.add(squatter)
    with pytest.raises(ConnectorError, match=r"409 Conflict\. The container name .* in use"):
        c.scale(decision(2, 1))
    with pytest.raises(ConnectorError, match="CONVEYOR_PLANNER_COMPOSE_SERVICES"):
        c.scale(decision(2, 1, pool="decode"))
    gone = ComposeConnector(
        {"generate": SERVICE}, project=PROJECT, socket_path=str(tmp_path / "none.sock")
    )
    with pytest.raises(ConnectorError, match="cannot reach the Docker daemon"):
        gone.replicas("generate")
    empty = ComposeConnector({"generate": "nothing"}, project=PROJECT,
                             socket_path=docker.socket_path)  # fmt: skip
    with pytest.raises(ConnectorError, match="no container to clone"):
        empty.scale(decision(1, 0))


def test_clone_body_without_networks_is_the_config_alone() -> None:
    source = container(PROJECT, SERVICE, 4)
    source["NetworkSettings"]["Networks"] = {}
    source["HostConfig"]["NetworkMode"] = "none"
    body, extra = clone_body(source, 5, f"{PROJECT}-{SERVICE}-5")
    assert "NetworkingConfig" not in body and extra == {}
    assert body["Labels"]["com.docker.compose.container-number"] == "5"
    assert source["Config"]["Labels"]["com.docker.compose.container-number"] == "4"  # a copy


# --------------------------------------------------------------------------- kubernetes


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[FakeKubernetes, Path]]:
    token = tmp_path / "token"
    token.write_text("t0ken-1\n")
    with fake_kubernetes("serving", "t0ken-1") as api:
        api.add("conveyor-worker", 2)
        yield api, token


def kubernetes(api: FakeKubernetes, token: Path) -> KubernetesConnector:
    return KubernetesConnector(
        {"generate": "conveyor-worker"}, api=api.url, namespace="serving", token_file=str(token)
    )


def test_kubernetes_patches_the_scale_and_settles_once_rolled_out(
    kube: tuple[FakeKubernetes, Path],
) -> None:
    """Against a fake API server (unit tests only)."""
    api, token = kube
    c = kubernetes(api, token)
    assert c.replicas("generate") == 2
    up = decision(3, 2)
    c.scale(up)
    assert api.patches == [("conveyor-worker", "application/merge-patch+json",
                            {"spec": {"replicas": 3}})]  # fmt: skip
    assert c.replicas("generate") == 3
    assert not c.settled(up)  # the controller has not seen the new generation
    api.roll_out("conveyor-worker")
    assert c.settled(up)
    down = decision(0, 3)
    c.scale(down)
    assert not c.settled(down)
    api.roll_out("conveyor-worker")  # readyReplicas left out at 0
    assert c.settled(down) and c.replicas("generate") == 0


def test_kubernetes_rereads_the_token_and_reports_the_api_servers_errors(
    kube: tuple[FakeKubernetes, Path],
) -> None:
    """Against a fake API server (unit tests only)."""
    api, token = kube
    c = kubernetes(api, token)
    assert c.replicas("generate") == 2
    api.token = "t0ken-2"  # rotated: the old one is refused ...
    with pytest.raises(ConnectorError, match="401 Unauthorized"):
        c.replicas("generate")
    token.write_text("t0ken-2\n")  # ... and the connector reads the new one
    assert c.replicas("generate") == 2
    gone = KubernetesConnector({"generate": "nope"}, api=api.url, namespace="serving",
                               token_file=str(token))  # fmt: skip
    with pytest.raises(ConnectorError, match='404 deployments.apps "nope" not found'):
        gone.scale(decision(1, 0))
    with pytest.raises(ConnectorError, match="CONVEYOR_PLANNER_K8S_DEPLOYMENTS"):
        c.replicas("decode")
    token.unlink()
    with pytest.raises(ConnectorError, match="CONVEYOR_PLANNER_K8S_TOKEN_FILE"):
        c.replicas("generate")


# --------------------------------------------------------------------------- construction


def test_parse_pool_map() -> None:
    assert parse_pool_map(" generate = worker-generate , decode=dec,") == {
        "generate": "worker-generate", "decode": "dec"
    }  # fmt: skip
    assert parse_pool_map("") == {}
    for bad, why in (("generate", "not POOL=NAME"), ("=w", "not POOL=NAME"),
                     ("a=b,a=c", "mapped twice")):  # fmt: skip
        with pytest.raises(ValueError, match=f"CONVEYOR_X: .*{why}"):
            parse_pool_map(bad, "CONVEYOR_X")


def test_build_connector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = redis.Redis(port=9)  # never connected
    opts = ConnectorOptions()
    assert isinstance(build_connector("advisory", client, opts), AdvisoryConnector)
    virtual = build_connector("virtual", client, opts)
    assert isinstance(virtual, VirtualConnector) and virtual.client is client
    with pytest.raises(ValueError, match="CONVEYOR_PLANNER_CONNECTOR.*'autoscale'.*advisory"):
        build_connector("autoscale", client, opts)
    with pytest.raises(ValueError, match="conveyor serve --planner"):
        build_connector("serve", client, opts)
    with pytest.raises(ValueError, match="CONVEYOR_PLANNER_COMPOSE_SERVICES"):
        build_connector("compose", client, opts)
    with pytest.raises(ValueError, match="CONVEYOR_PLANNER_K8S_DEPLOYMENTS"):
        build_connector("kubernetes", client, opts)
    opts.k8s_deployments = {"generate": "conveyor-worker"}
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConnectorError, match="CONVEYOR_PLANNER_K8S_API"):
        build_connector("kubernetes", client, opts)
    opts.k8s_api, opts.k8s_namespace = "http://127.0.0.1:9", "ns"
    k8s = build_connector("kubernetes", client, opts)
    assert isinstance(k8s, KubernetesConnector) and k8s.namespace == "ns"
    with fake_docker(tmp_path) as docker:
        docker.add(container(PROJECT, SERVICE, 1))
        opts.compose_services = {"generate": SERVICE}
        opts.compose_project = PROJECT
        opts.docker_host = "unix://" + docker.socket_path
        made = build_connector("compose", client, opts)
        assert isinstance(made, ComposeConnector) and made.replicas("generate") == 1


def test_docker_socket() -> None:
    assert docker_socket(None) == "/var/run/docker.sock"
    assert docker_socket("unix:///run/user/1000/docker.sock") == "/run/user/1000/docker.sock"
    with pytest.raises(ValueError, match="unix socket only"):
        docker_socket("tcp://127.0.0.1:2375")
