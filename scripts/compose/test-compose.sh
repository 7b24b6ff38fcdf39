#!/usr/bin/env bash
# `make test-compose`: the docker compose deployment built and checked for real.
#
#   1. Docker: scripts/compose/docker-setup.sh installs and starts what is missing (Debian,
#      root); where Docker cannot be had, exit 77 with the reason.
#   2. Base images: BASE_IMAGE / REDIS_IMAGE if given, else python:3.11-slim and
#      redis:7-alpine, pulled; where no registry answers, stand-ins made from Debian's
#      packages (scripts/compose/base-images.sh), kept between runs.
#   3. Compose v1.29 (docker-compose, where installed) loads the file with every profile.
#   4. The image, built through compose with this machine's pip settings turned into build
#      arguments: pip's CA bundle as the pip_ca build secret (scripts/compose/pip-ca.yml),
#      a CPU torch wheel from pip's find-links through WHEELS_DIR (linked into wheels/).
#      Its size must stay within 1.5 GB.
#   5. tests/compose (pytest, the official openai client) against the stack, on free
#      127.0.0.1 ports under the project name conveyor-ci.
#   6. `down -v`, which must leave no container, network or volume of the project.
#
# Extra arguments go to pytest. One run at a time per machine (a lock); the stack is taken
# down whatever happens. Each step prints its time.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-.venv/bin/python}
PROJECT=conveyor-ci
IMAGE_LIMIT=1500000000  # bytes: the CPU image's target size
T0=$(date +%s)
STEP_T=$T0

say() { echo "test-compose: $*"; }
step() {
  local now
  now=$(date +%s)
  say "$* ($((now - STEP_T)) s)"
  STEP_T=$now
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# 1. Docker
if ! scripts/compose/docker-setup.sh; then
  say "NOT run: Docker cannot be had here (the reason is above)"
  exit 77
fi
step "docker ready"
# taken after the setup, so that a dockerd it starts does not inherit the lock
exec 9>/tmp/conveyor-test-compose.lock
flock -n 9 || { say "another run holds /tmp/conveyor-test-compose.lock: waiting"; flock 9; }

# 2. base images
if [ -z "${BASE_IMAGE:-}" ] && [ -z "${REDIS_IMAGE:-}" ]; then
  BASE_IMAGE=python:3.11-slim REDIS_IMAGE=redis:7-alpine
  for image in "$BASE_IMAGE" "$REDIS_IMAGE"; do
    have_image "$image" || timeout 300 docker pull -q "$image" >/dev/null 2>&1 || {
      say "cannot pull $image: stand-ins from Debian's packages instead"
      BASE_IMAGE=conveyor-ci/python:3.11 REDIS_IMAGE=conveyor-ci/redis:7
      scripts/compose/base-images.sh "$BASE_IMAGE" "$REDIS_IMAGE"
      break
    }
  done
fi
export BASE_IMAGE=${BASE_IMAGE:?set both BASE_IMAGE and REDIS_IMAGE, or neither}
export REDIS_IMAGE=${REDIS_IMAGE:?set both BASE_IMAGE and REDIS_IMAGE, or neither}
step "base images: $BASE_IMAGE, $REDIS_IMAGE"

# the stack's settings: .env.example with fresh secrets, free ports, the CI image tag
work=$(mktemp -d)
linked=""
files=(docker-compose.yml)
compose() {
  local args=(-p "$PROJECT" --env-file "$work/ci.env")
  for f in "${files[@]}"; do args+=(-f "$f"); done
  docker compose "${args[@]}" "$@"
}
cleanup() {
  local rc=$?
  compose --profile disagg --profile encode --profile gpu down -v --remove-orphans -t 10 \
    >/dev/null 2>&1 || true
  [ -z "$linked" ] || rm -f "$linked"
  rmdir wheels 2>/dev/null || true
  rm -rf "$work"
  # images this project built before (dangling now), and the build cache beyond 5 GB (the
  # torch and dependency layers stay for the next run)
  docker image prune -f --filter "label=com.docker.compose.project=$PROJECT" >/dev/null 2>&1 || true
  docker buildx prune -f --keep-storage 5gb >/dev/null 2>&1 || true
  exit "$rc"
}
trap cleanup EXIT
secret() { "$PY" -c 'import secrets; print(secrets.token_hex(16))'; }
sed -e "s/^REDIS_PASSWORD=.*/REDIS_PASSWORD=$(secret)/" \
    -e "s/^FLOWER_BASIC_AUTH=.*/FLOWER_BASIC_AUTH=ci:$(secret)/" .env.example >"$work/ci.env"
read -r api_port flower_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export CONVEYOR_PORT=$api_port CONVEYOR_FLOWER_PORT=$flower_port
export CONVEYOR_IMAGE=conveyor-ci/conveyor:latest CONVEYOR_TORCH_THREADS=1

# 4's build arguments from this machine's pip settings
pip_setting() {  # the environment's PIP_X, else pip's configuration global.x
  local var=$1 key=$2
  if [ -n "${!var:-}" ]; then echo "${!var}"; else "$PY" -m pip config get "$key" 2>/dev/null || true; fi
}
ca=$(pip_setting PIP_CERT global.cert)
if [ -n "$ca" ] && [ -s "$ca" ]; then
  export PIP_CA_FILE=$ca
  files+=(scripts/compose/pip-ca.yml)
  say "pip's CA bundle $ca goes in as the pip_ca build secret"
fi
torch=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
if [ -z "${WHEELS_DIR:-}" ]; then
  for dir in $(pip_setting PIP_FIND_LINKS global.find-links); do
    wheel=$(compgen -G "$dir/torch-$torch+cpu-cp311-*.whl" | head -n 1) || continue
    mkdir -p wheels
    if [ ! -e "wheels/$(basename "$wheel")" ]; then
      linked=wheels/$(basename "$wheel")
      ln "$wheel" "$linked" 2>/dev/null || cp "$wheel" "$linked"
    fi
    export WHEELS_DIR=wheels TORCH_VERSION=$torch+cpu TORCH_INDEX_URL=https://pypi.org/simple
    say "torch $TORCH_VERSION from pip's find-links ($wheel), the rest from PyPI"
    break
  done
fi

# 3. Compose v1.29 loads the file (config, then a command that builds the project)
if command -v docker-compose >/dev/null 2>&1; then
  v1=(docker-compose -p "$PROJECT" --env-file "$work/ci.env" -f docker-compose.yml
      --profile disagg --profile encode --profile gpu)
  "${v1[@]}" config -q && "${v1[@]}" ps >/dev/null
  step "$(docker-compose version --short): the file loads with every profile"
else
  say "Compose v1.29 check NOT run: no docker-compose on PATH"
fi

# 4. build: every Conveyor service has the same build and image tag, so building one (api)
# builds the image for all of them
if ! compose --progress plain build api >"$work/build.log" 2>&1; then
  tail -n 60 "$work/build.log"
  say "FAILED: the image does not build"
  exit 1
fi
size=$(docker image inspect -f '{{.Size}}' "$CONVEYOR_IMAGE")
step "built $CONVEYOR_IMAGE: $(numfmt --to=si --format %.2f "$size")B ($size bytes)"
if [ "$size" -gt "$IMAGE_LIMIT" ]; then
  say "FAILED: the image is $(numfmt --to=si --format %.2f "$size")B, over its 1.5 GB"
  exit 1
fi

# 5. the checks, on a stack started from nothing: a run cut short before its cleanup (a
# killed job, a stopped dockerd) can leave the project's containers and volumes, and Redis's
# volume would carry its state (adapters, batches, keys) into this run
label="label=com.docker.compose.project=$PROJECT"
if [ -n "$(docker ps -aq --filter "$label")$(docker volume ls -q --filter "$label")" ]; then
  compose --profile disagg --profile encode --profile gpu down -v --remove-orphans -t 10 \
    >/dev/null 2>&1 || true
  step "removed what an earlier run of $PROJECT left"
fi
export CONVEYOR_COMPOSE_PROJECT=$PROJECT CONVEYOR_COMPOSE_ENV_FILE=$work/ci.env
CONVEYOR_COMPOSE_FILES=$(IFS=:; echo "${files[*]}")
export CONVEYOR_COMPOSE_FILES
rc=0
"$PY" -m pytest -v -s -p no:cacheprovider tests/compose "$@" || rc=$?
step "tests/compose"
if [ "$rc" != 0 ]; then
  compose --profile disagg --profile encode ps -a || true
  compose --profile disagg --profile encode logs --tail 40 || true
  say "FAILED: tests/compose (exit $rc)"
  exit "$rc"
fi

# 6. down -v leaves nothing behind
compose --profile disagg --profile encode --profile gpu down -v --remove-orphans -t 30 \
  >/dev/null 2>&1
left="$(docker ps -aq --filter "$label") $(docker network ls -q --filter "$label")"
left+=" $(docker volume ls -q --filter "$label")"
if [ -n "${left// /}" ]; then
  say "FAILED: down -v left behind: $left"
  exit 1
fi
step "down -v: no container, network or volume left"
say "passed in $(($(date +%s) - T0)) s"
