"""Static checks of the container deployment: docker-compose.yml, .env.example, Dockerfile,
.dockerignore. (`make test-compose`, tests/compose, runs the deployment for real.)

No Docker engine is needed: the compose file is parsed with PyYAML (anchors and ``<<``
merge keys resolve under ``safe_load``), its ``${VAR...}`` references are resolved the
way Compose resolves them, and the ``docker compose`` commands of docs/operations.md are read to
work out which services each of them starts. The Dockerfile is read as text.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tasks.modes import ALIASES, MODES

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DOC = ROOT / "docs" / "operations.md"  # its "Deploy with Docker Compose" section
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"

DISAGG_WORKERS = {"worker-prefill": "prefill", "worker-decode": "decode"}
WORKERS = ("worker-generate", "worker-generate-gpu", *DISAGG_WORKERS, "worker-encode")
CONVEYOR_SERVICES = ("api", "flower", *WORKERS)
ALL_SERVICES = ("redis", *CONVEYOR_SERVICES)
# the packages pyproject.toml installs: the image must copy each of them
PACKAGES = tuple(
    p.rstrip("*")
    for p in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]["include"]
)


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    svcs = compose.get("services")
    assert isinstance(svcs, dict), "docker-compose.yml has no services mapping"
    return svcs


def _argv(command: Any) -> list[str]:
    """A compose ``command``/``test`` in either string or list form, as argv."""
    if isinstance(command, str):
        return shlex.split(command)
    assert isinstance(command, list), f"unexpected command form: {command!r}"
    return [str(c) for c in command]


def _env(service: dict[str, Any]) -> dict[str, str]:
    """``environment`` in mapping or ``KEY=VALUE`` list form, as a dict."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        out = {}
        for item in env:
            key, _, value = str(item).partition("=")
            out[key] = value
        return out
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


_SHORT_PORT = re.compile(
    r"^(?:(?P<ip>\d{1,3}(?:\.\d{1,3}){3}):)?(?:(?P<published>.+):)?(?P<target>\d+)(?:/(?P<proto>\w+))?$"
)


def _ports(service: dict[str, Any]) -> list[dict[str, str]]:
    """Published ports (short or long syntax) as {host_ip, published, target}."""
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            out.append(
                {
                    "host_ip": str(entry.get("host_ip", "")),
                    "published": str(entry.get("published", "")),
                    "target": str(entry["target"]),
                }
            )
        else:
            m = _SHORT_PORT.match(str(entry))
            assert m, f"unparseable port mapping {entry!r}"
            out.append(
                {
                    "host_ip": m["ip"] or "",
                    "published": m["published"] or "",
                    "target": m["target"],
                }
            )
    return out


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile instructions as (KEYWORD, arguments), continuation lines joined."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continuation
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        logical.append(buf)
        buf = ""
    if buf.strip():
        logical.append(buf)
    out = []
    for ins in logical:
        keyword, _, args = ins.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return _instructions(DOCKERFILE.read_text())


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for kw, args in instructions:
        if kw == "ARG" and "=" in args:
            key, _, value = args.partition("=")
            out[key.strip()] = value.strip().strip('"')
    return out


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


# --------------------------------------------------------------------------- compose


def test_compose_has_expected_services_and_no_version_key(compose, services):
    assert "version" not in compose, "compose spec files have no top-level `version:`"
    for name in ALL_SERVICES:
        assert name in services, f"service {name!r} missing"


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_redis_is_private_persistent_and_asks_for_a_password(compose, services):
    """Redis: not published; a password; an append-only file on a named volume (a restart
    keeps the queued work; `down -v` deletes it); its probe logs in and wants PONG."""
    redis = services["redis"]
    assert redis["image"] == "${REDIS_IMAGE:-redis:7-alpine}"
    assert "ports" not in redis, "redis must not be published to the host"
    argv = _argv(redis["command"])
    assert argv[0] == "redis-server"
    assert _flag(argv, "--requirepass").startswith("${REDIS_PASSWORD:?")
    assert _flag(argv, "--appendonly") == "yes"
    assert _flag(argv, "--save") == "", 'RDB snapshots off (--save ""): the AOF is the record'
    assert redis["volumes"] == [f"redis-data:{_flag(argv, '--dir')}"]
    assert "redis-data" in compose["volumes"]
    assert _env(redis)["REDISCLI_AUTH"] == _flag(argv, "--requirepass")
    assert _argv(redis["healthcheck"]["test"]) == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]


@pytest.mark.parametrize("name", ALL_SERVICES)
def test_every_service_has_a_healthcheck(services, name):
    hc = services[name].get("healthcheck")
    assert isinstance(hc, dict) and hc.get("test"), f"{name} has no healthcheck test"
    assert not hc.get("disable"), f"{name} healthcheck is disabled"
    argv = _argv(hc["test"])
    assert argv[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck test must be exec form"
    assert len(argv) > 1


@pytest.mark.parametrize(("name", "port"), [("api", "8000"), ("flower", "5555")])
def test_front_services_publish_on_loopback_only(services, name, port):
    ports = _ports(services[name])
    assert ports, f"{name} publishes no port"
    assert [p["target"] for p in ports] == [port]
    for p in ports:
        assert p["host_ip"] == "127.0.0.1", f"{name} must bind to 127.0.0.1, got {p}"
        assert p["published"], f"{name} must publish a fixed host port"


@pytest.mark.parametrize("name", WORKERS)
def test_workers_are_scalable(services, name):
    svc = services[name]
    assert "ports" not in svc, f"{name} publishes ports: --scale would collide"
    assert "container_name" not in svc, f"{name} has container_name: --scale impossible"


def test_the_front_services_run_and_probe_what_they_publish(services):
    """The API and Flower listen on all of the container's interfaces, on the port the
    host side publishes (on 127.0.0.1, tested above), and their probes ask that port."""
    api, flower = services["api"], services["flower"]
    assert _argv(api["command"]) == ["conveyor", "api", "--host", "0.0.0.0", "--port", "8000"]
    assert _argv(flower["command"]) == ["conveyor", "flower", "--host", "0.0.0.0", "--port",
                                        "5555"]  # fmt: skip
    api_probe = " ".join(_argv(api["healthcheck"]["test"]))
    assert "python" in api_probe and "curl" not in api_probe  # the image has no curl
    assert "http://127.0.0.1:8000/health" in api_probe
    assert "127.0.0.1:5555" in " ".join(_argv(flower["healthcheck"]["test"]))


@pytest.mark.parametrize("name", CONVEYOR_SERVICES)
def test_conveyor_services_wait_for_healthy_redis(services, name):
    deps = services[name].get("depends_on")
    assert isinstance(deps, dict), f"{name}: depends_on must use the long form"
    assert deps.get("redis", {}).get("condition") == "service_healthy", name


@pytest.mark.parametrize("name", CONVEYOR_SERVICES)
def test_conveyor_services_build_from_repo_root(services, name):
    build = services[name].get("build")
    assert isinstance(build, dict), f"{name} has no build section"
    assert build.get("context") == ".", name
    assert build.get("dockerfile", "Dockerfile") == "Dockerfile", name


@pytest.mark.parametrize("name", CONVEYOR_SERVICES)
def test_conveyor_services_point_at_the_redis_service(services, name):
    url = _env(services[name]).get("CONVEYOR_REDIS_URL", "")
    want = r"redis://:\$\{REDIS_PASSWORD:\?[^}]+\}@redis:6379/\d+"
    assert re.fullmatch(want, url), f"{name}: CONVEYOR_REDIS_URL={url!r}"


@pytest.mark.parametrize("name", WORKERS)
def test_workers_drain_before_they_are_killed(services, name):
    """`docker stop` gives a worker its warm shutdown: minutes, not Docker's 10 s."""
    grace = services[name].get("stop_grace_period", "10s")
    assert re.fullmatch(r"\d+m", grace) and int(grace[:-1]) >= 2, f"{name}: {grace}"


def test_every_build_argument_comes_from_the_environment(services, dockerfile):
    """Each build argument is `${NAME:-default}` with the Dockerfile's own default, so a
    mirror, a wheel folder or another base image is one variable away."""
    args = services["api"]["build"]["args"]
    defaults = _arg_defaults(dockerfile)
    assert set(args) == {"BASE_IMAGE", "TORCH_VERSION", "TORCH_INDEX_URL", "INDEX_URL",
                         "EXTRA_INDEX_URL", "WHEELS_DIR"}  # fmt: skip
    for name, value in args.items():
        assert value == f"${{{name}:-{defaults[name]}}}", (name, value)
    for name in CONVEYOR_SERVICES:
        if name != "worker-generate-gpu":
            assert services[name]["build"] == services["api"]["build"], name


def test_gpu_worker_reserves_an_nvidia_gpu(services):
    gpu = services["worker-generate-gpu"]
    assert gpu.get("profiles") == ["gpu"]
    assert _env(gpu).get("CONVEYOR_DEVICE") == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    nvidia = [d for d in devices if d.get("driver") == "nvidia"]
    assert nvidia, "no nvidia device reservation"
    dev = nvidia[0]
    assert "gpu" in dev.get("capabilities", [])
    # a number as written: Compose v1.29 reads an interpolated ${VAR} as a string and
    # refuses the whole file, gpu profile or not
    assert isinstance(dev.get("count"), int), dev.get("count")
    # CUDA torch wheels, one NIXL build for that CUDA, and an image tag that does not
    # clobber the CPU image; the other build arguments as the CPU image's.
    args = gpu["build"]["args"]
    assert "/whl/cu128" in args["TORCH_INDEX_URL"] and args["NIXL_CUDA"] == "${NIXL_CUDA:-cu12}"
    own = ("TORCH_INDEX_URL", "NIXL_CUDA", "EXTRAS")
    cpu_args = services["api"]["build"]["args"]
    assert {k: v for k, v in args.items() if k not in own} == {
        k: v for k, v in cpu_args.items() if k not in own
    }
    assert gpu.get("image") != services["worker-generate"].get("image")
    # vLLM's engine by default, from an image with the vllm extra (pyproject.toml)
    assert _env(gpu).get("CONVEYOR_ENGINE") == "${CONVEYOR_GPU_ENGINE:-vllm}"
    assert "vllm" in str(args.get("EXTRAS", "")).split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("vllm") for r in extras["vllm"])
    cpu = services["worker-generate"]
    assert _env(cpu).get("CONVEYOR_DEVICE", "cpu") == "cpu"
    assert "deploy" not in cpu or "devices" not in str(cpu["deploy"])


def test_workers_set_torch_threads(services):
    for name in WORKERS:
        assert "CONVEYOR_TORCH_THREADS" in _env(services[name]), name


@pytest.mark.parametrize("name", DISAGG_WORKERS)
def test_disagg_workers_share_the_cpu_image_and_pick_a_kv_transfer(services, name):
    svc, gen = services[name], services["worker-generate"]
    assert svc.get("image") == gen.get("image"), name
    assert svc.get("build") == gen.get("build"), name
    env = _env(svc)
    assert env.get("CONVEYOR_KV_TRANSFER") == "${CONVEYOR_KV_TRANSFER:-auto}", name
    assert env.get("CONVEYOR_DEVICE", "cpu") == "cpu", name
    assert "deploy" not in svc or "devices" not in str(svc["deploy"]), name


def _as_setting(text: str, default: object) -> object:
    """A compose default as the setting reads it: an empty one is unset (None), a bool's
    is true / false, the rest by the default's type."""
    if default is None:
        return None if text == "" else text
    if isinstance(default, bool):
        return {"true": True, "false": False}[text.lower()]
    return type(default)(text)


def test_compose_defaults_match_settings(services):
    """`${CONVEYOR_X:-default}` defaults repeat tasks/settings.py's; keep them in step."""
    settings = pytest.importorskip("tasks.settings")
    checked = set()
    for name in CONVEYOR_SERVICES:
        for key, value in _env(services[name]).items():
            m = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", value)
            if (
                not m
                or m[1] != key
                or key in ("CONVEYOR_MODEL",)
                or not key.startswith("CONVEYOR_")
            ):  # OTEL_*: the SDK's, not ours
                continue
            try:
                default = settings.field_info(key.removeprefix("CONVEYOR_").lower()).default
            except KeyError:
                raise AssertionError(f"{name}: {key} is no setting") from None
            got = _as_setting(m[2], default)
            assert got == default, f"{name}: {key} default {m[2]!r} != {default!r}"
            checked.add(key)
    assert {
        "CONVEYOR_MODE",
        "CONVEYOR_KV_TRANSFER",
        "CONVEYOR_DISAGG_MIN_PROMPT_TOKENS",
        "CONVEYOR_KV_PIN_TIMEOUT_S",
        "CONVEYOR_TRANSFER_TIMEOUT_S",
        "CONVEYOR_PREFILL_RETRIES",
        "CONVEYOR_LORA_MODULES",
        "CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING",
        "CONVEYOR_OTLP_TRACES_ENDPOINT",
        "CONVEYOR_LOG_FORMAT",
        "CONVEYOR_SPECULATIVE_CONFIG",
    } <= checked


# --------------------------------------------------------------------------- what starts

_REF = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


class Refused(Exception):
    """Compose refuses to start: a required variable is missing."""


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with its ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR-default}``
    / ``${VAR:?message}`` / ``${VAR?message}`` references resolved against ``env``, as
    Compose resolves them (``$$`` is a literal ``$``); lists and mappings recursively."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name, op, arg = m[1] or m[4], m[2], m[3]
        have = env.get(name)
        unset = have is None or (have == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("?") and unset:
            raise Refused(f"{name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return have or ""

    return _REF.sub(one, value)


@dataclass(frozen=True)
class Instruction:
    """One ``docker compose ... up`` command of docs/operations.md's deployment section."""

    text: str
    env: dict[str, str]  # the variables compose sees: .env (from .env.example) and its own
    profiles: tuple[str, ...]
    scale: dict[str, int]

    @property
    def mode(self) -> str:
        return self.env.get("CONVEYOR_MODE", "agg")  # the default every service falls back to

    @property
    def row(self) -> str:
        """The stage table's row the mode names (``disagg`` is ``ep-d``)."""
        return ALIASES.get(self.mode, self.mode)


def _env_example() -> dict[str, str]:
    """The variables .env.example sets (its KEY=VALUE lines)."""
    lines = ENV_EXAMPLE.read_text().splitlines()
    pairs = [ln.partition("=") for ln in lines if ln and not ln.startswith("#")]
    return {key.strip(): value.strip() for key, _, value in pairs}


def _readme_instructions() -> list[Instruction]:
    """The ``docker compose ... up`` commands of docs/operations.md's block, which starts by
    copying .env.example to .env (Compose reads it)."""
    text = DEPLOY_DOC.read_text()
    section = text[text.index("## Deploy with Docker Compose") :]
    start = section.index("```bash") + len("```bash")
    block = section[start : section.index("```", start)]
    lines = re.sub(r"\\\n\s*", " ", block).strip().splitlines()
    assert shlex.split(lines[0], comments=True) == ["cp", ".env.example", ".env"], lines[0]
    out = []
    for line in lines[1:]:
        argv = shlex.split(line, comments=True)
        env = _env_example()
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        assert argv[:2] == ["docker", "compose"], line
        if "up" not in argv:
            continue
        profiles, scale = [], {}
        for flag, arg in zip(argv, argv[1:], strict=False):
            if flag == "--profile":
                profiles.append(arg)
            elif flag == "--scale":
                svc, _, n = arg.partition("=")
                scale[svc] = int(n)
        out.append(Instruction(" ".join(line.split("#")[0].split()), env, tuple(profiles), scale))
    return out


INSTRUCTIONS = _readme_instructions()


def _started(services: dict[str, dict[str, Any]], ins: Instruction) -> dict[str, dict]:
    """The services ``ins`` starts (in no profile or in one it enables, not scaled to 0),
    their references resolved against the variables it sets."""
    for svc in ins.scale:
        assert svc in services, f"{ins.text}: --scale names no service {svc!r}"
    return {
        name: _interpolate(svc, ins.env)
        for name, svc in services.items()
        if (not svc.get("profiles") or set(svc["profiles"]) & set(ins.profiles))
        and ins.scale.get(name, 1) > 0
    }


def _worker_pool(svc: dict[str, Any]) -> str | None:
    """The pool a service's ``conveyor worker --pool P`` command runs (None: no worker)."""
    argv = _argv(svc.get("command", []))
    if argv[:2] != ["conveyor", "worker"]:
        return None
    assert argv[2:] == ["--pool", argv[-1]], f"unexpected worker command {argv}"
    return argv[-1]


def test_the_docs_say_how_to_run_every_mode():
    assert {ins.row for ins in INSTRUCTIONS} == set(MODES), [i.text for i in INSTRUCTIONS]


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: i.text)
def test_each_compose_command_starts_a_worker_for_every_pool_of_its_mode(services, ins):
    """What ``docker compose`` starts for each command of the docs: for every pool of
    the mode it selects (tasks.modes), a worker service running ``conveyor worker --pool
    <pool>`` with the healthcheck ``conveyor worker-health --pool <pool>``; no worker of
    another pool; and every Conveyor service set to that mode."""
    started = _started(services, ins)
    pools: dict[str, list[str]] = {}
    for name, svc in started.items():
        pool = _worker_pool(svc)
        if pool is not None:
            pools.setdefault(pool, []).append(name)
            probe = _argv(svc["healthcheck"]["test"])
            assert probe == ["CMD", "conveyor", "worker-health", "--pool", pool], name
    assert set(pools) == set(MODES[ins.row].pools), pools
    assert {"redis", "api", "flower"} <= set(started)
    for name, svc in started.items():
        if name != "redis":
            assert _env(svc)["CONVEYOR_MODE"] == ins.mode, name


def test_env_example_sets_every_variable_the_file_requires(compose):
    """The deploy block starts with `cp .env.example .env`: that is enough to start everything."""
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE.read_text()))
    assert required == {"REDIS_PASSWORD", "FLOWER_BASIC_AUTH"}
    env = _env_example()
    assert required <= {k for k, v in env.items() if v}
    _interpolate(compose, env)  # refuses nothing


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: i.text)
def test_nothing_starts_without_the_redis_password(services, ins):
    """Redis and every Conveyor service refuse to start without REDIS_PASSWORD."""
    without = {k: v for k, v in ins.env.items() if k != "REDIS_PASSWORD"}
    for name, svc in _started(services, ins).items():
        with pytest.raises(Refused):
            _interpolate(services[name], without)
        assert ins.env["REDIS_PASSWORD"] in str(svc), name


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: i.text)
def test_flower_never_starts_without_credentials(services, ins):
    """Compose refuses to start Flower unless FLOWER_BASIC_AUTH is set and not empty
    (.env.example sets it); its value reaches ``conveyor flower`` as the basic auth, and
    no other service gets it."""
    without = {k: v for k, v in ins.env.items() if k != "FLOWER_BASIC_AUTH"}
    for env in (without, {**without, "FLOWER_BASIC_AUTH": ""}):
        with pytest.raises(Refused):
            _interpolate(services["flower"], env)
    started = _started(services, ins)
    assert _env(started["flower"])["CONVEYOR_FLOWER_BASIC_AUTH"] == ins.env["FLOWER_BASIC_AUTH"]
    for name, svc in started.items():
        if name != "flower":
            assert "CONVEYOR_FLOWER_BASIC_AUTH" not in _env(svc), name


# --------------------------------------------------------------------------- Dockerfile


def _stages(dockerfile: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (from its FROM on), in order."""
    out: list[list[tuple[str, str]]] = []
    for kw, args in dockerfile:
        if kw == "FROM":
            out.append([])
        if out:
            out[-1].append((kw, args))
    return out


def test_dockerfile_builds_in_two_stages_on_one_base(dockerfile):
    """A builder and a runtime stage, both on BASE_IMAGE (python:3.11-slim unless given):
    the venv copied from one to the other finds the same interpreter."""
    assert dockerfile[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    builder, runtime = _stages(dockerfile)
    assert builder[0] == ("FROM", "${BASE_IMAGE} AS builder")
    assert runtime[0] == ("FROM", "${BASE_IMAGE}")
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    exposed = {p for kw, args in runtime if kw == "EXPOSE" for p in args.split()}
    assert {"8000", "5555"} <= exposed


def test_dockerfile_runtime_stage_has_no_compiler_and_no_pip_cache(dockerfile):
    builder, runtime = _stages(dockerfile)
    runs = " ".join(a for kw, a in runtime if kw == "RUN")
    for word in ("apt-get", "gcc", "pip "):
        assert word not in runs, f"the runtime stage runs {word!r}"
    assert any(kw == "RUN" and "apt-get install" in a and "gcc" in a for kw, a in builder)
    env = " ".join(a for kw, a in builder if kw == "ENV")
    assert "PIP_NO_CACHE_DIR=1" in env
    installs = [a for kw, a in builder if kw == "RUN" and 'pip-install "${' in a]
    # torch, the dependencies, xgrammar without triton, the project
    assert len(installs) == 4
    assert any('--no-deps "xgrammar==' in a for a in installs)
    for a in installs:
        assert a.startswith("--mount=type=secret,id=pip_ca "), a


def test_dockerfile_pins_torch_before_installing_the_project(dockerfile):
    builder, _ = _stages(dockerfile)
    args = _arg_defaults(builder)
    assert args.get("TORCH_VERSION") == "2.13.0"
    assert args.get("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    assert args.get("INDEX_URL") == "https://pypi.org/simple"
    assert args.get("EXTRAS") == "model"
    runs = [(i, a) for i, (kw, a) in enumerate(builder) if kw == "RUN" and 'pip-install "' in a]
    torch = [i for i, a in runs if '"${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in a]
    project = [i for i, a in runs if '"${INDEX_URL}" ".[${EXTRAS}]"' in a]
    assert torch and project and torch[0] < project[0], "torch must be installed first"


def test_dockerfile_installs_one_nixl_build_only_when_asked(dockerfile):
    """No NIXL on the CPU image (NIXL_CUDA empty); else the CUDA build it names and the
    `nixl` meta package without its dependencies (which would pull both CUDA builds)."""
    builder, _ = _stages(dockerfile)
    assert _arg_defaults(builder).get("NIXL_CUDA") == ""
    run = next(a for kw, a in builder if kw == "RUN" and "nixl" in a)
    assert 'if [ -n "${NIXL_CUDA}" ]' in run
    assert '"nixl-${NIXL_CUDA}==${NIXL_VERSION}"' in run
    assert '--no-deps "nixl==${NIXL_VERSION}"' in run
    assert "nixl" not in _arg_defaults(builder)["EXTRAS"]


def test_dockerfile_installs_the_dependencies_before_copying_the_code(dockerfile):
    """pyproject.toml, then the dependencies, then the code and the README, then the project
    without dependencies: a change to the code does not reinstall the dependencies."""
    builder, _ = _stages(dockerfile)

    def at(kw: str, text: str) -> int:
        return next(i for i, (k, a) in enumerate(builder) if k == kw and text in a)

    deps = at("RUN", '".[${EXTRAS}]"')
    assert at("COPY", "pyproject.toml") < deps
    for item in ("README.md", *PACKAGES):
        assert deps < at("COPY", item) < at("RUN", "--no-deps ."), item
    # the wheels folder is the only other part of the context the installs see
    assert at("COPY", "${WHEELS_DIR:-no-wheels}* /wheels/") < at("RUN", "torch==")


def test_dockerfile_builds_the_kernel_in_the_builder(dockerfile):
    """The decode kernel is compiled by workers/paged_kernel.py in the builder stage into
    CONVEYOR_KERNEL_DIR, which the runtime stage copies and points at, with CC naming the
    stand-in that answers for the compiler there."""
    builder, runtime = _stages(dockerfile)
    build = next(a for kw, a in builder if kw == "RUN" and "paged_kernel.load(" in a)
    assert "cc --version" in build and "/opt/conveyor/bin/cc" in build
    for stage in (builder, runtime):
        env = " ".join(a for kw, a in stage if kw == "ENV")
        assert "CONVEYOR_KERNEL_DIR=/opt/conveyor/kernels" in env
    env = " ".join(a for kw, a in runtime if kw == "ENV")
    assert "CC=/opt/conveyor/bin/cc" in env
    assert ("COPY", "--from=builder /opt/conveyor /opt/conveyor") in runtime


def test_dockerfile_runs_as_non_root_with_the_default_model(dockerfile):
    builder, runtime = _stages(dockerfile)
    users = [a.split(":")[0] for kw, a in runtime if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), "final USER must be non-root"
    assert any(kw == "RUN" and "conveyor model init /models/tiny-llava" in a for kw, a in builder)
    assert ("COPY", "--from=builder --chown=conveyor:conveyor /models /models") in runtime
    env = " ".join(a for kw, a in runtime if kw == "ENV")
    assert re.search(r"CONVEYOR_MODEL[= ]/models/tiny-llava\b", env)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last pattern that
    matches it or one of its parent folders decides; ``!`` patterns put it back."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for pat in patterns:
        keep = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
               for p in prefixes):  # fmt: skip
            out = not keep
    return out


def test_dockerignore_keeps_sources_and_drops_junk():
    patterns = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    needed = ["pyproject.toml", "README.md", "wheels/torch.whl"]
    needed += [f"{p}/__init__.py" for p in PACKAGES] + ["workers/paged_attention.c"]
    for path in needed:
        assert not _dockerignored(path, patterns), f".dockerignore excludes {path}"
    junk = [".git/HEAD", ".venv/bin/python", ".env", "tests/unit/x.py", "bench/x.py"]
    junk += ["scripts/x", "models/m.safetensors", "api/__pycache__/app.pyc", "Dockerfile"]
    for path in junk:
        assert _dockerignored(path, patterns), f".dockerignore lets {path} into the context"
