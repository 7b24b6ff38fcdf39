#!/usr/bin/env bash
# Docker for `make test-compose`: a running engine, the Compose v2 and buildx plugins, and
# Compose v1.29 (docker-compose) for the compatibility check. Whatever is missing is
# installed on Debian as root: the engine (docker.io), debootstrap (scripts/compose/
# base-images.sh) and Compose v1.29 from the system's own release; Compose v2 and buildx,
# which bookworm lacks, from trixie's docker-compose and docker-buildx packages, fetched
# through a temporary apt source and unpacked into /usr/libexec/docker/cli-plugins. With
# no init system to start dockerd, it is started in the background (log:
# /var/log/conveyor-dockerd.log).
#
# Exit 0 when Docker is ready; else 1, with the reason as the last line on stderr (.ci/run
# prints it: the compose tests are then not run). Compose v1.29 and debootstrap are only
# installed, never required: without them, their steps say they are skipped.
set -euo pipefail

PLUGINS=/usr/libexec/docker/cli-plugins
DOCKERD_LOG=/var/log/conveyor-dockerd.log

fail() {
  echo "docker-setup: $*" >&2
  exit 1
}

have() { command -v "$1" >/dev/null 2>&1; }

plugins_ok() { docker compose version >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; }

apt_install() {
  echo "docker-setup: apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Compose v2 and buildx from trixie: download the two .debs through a temporary source,
# which is removed again (and the package lists refreshed) whatever happens.
install_plugins_from_trixie() {
  local src=/etc/apt/sources.list.d/conveyor-compose-trixie.sources tmp
  tmp=$(mktemp -d)
  trap 'rm -f "'"$src"'"' EXIT
  cat >"$src" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  local ok=0
  echo "docker-setup: Compose v2 and buildx from Debian trixie (temporary apt source)"
  if apt-get update -qq >/dev/null \
    && (cd "$tmp" && apt-get download -qq docker-compose/trixie docker-buildx/trixie) >/dev/null 2>&1
  then
    mkdir -p "$PLUGINS"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
    install -m 0755 "$tmp"/root/usr/libexec/docker/cli-plugins/docker-compose \
      "$tmp"/root/usr/libexec/docker/cli-plugins/docker-buildx "$PLUGINS"/ && ok=1
  fi
  rm -f "$src"
  trap - EXIT
  rm -rf "$tmp"
  apt-get update -qq >/dev/null || true
  [ "$ok" = 1 ] || fail "could not fetch docker-compose and docker-buildx from trixie"
}

start_dockerd() {
  echo "docker-setup: starting dockerd (log: $DOCKERD_LOG)"
  setsid nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return
    sleep 1
  done
  tail -5 "$DOCKERD_LOG" >&2 || true
  fail "dockerd did not start within 60 s (see $DOCKERD_LOG)"
}

# As root with apt: install what is missing (Compose v1.29 and debootstrap too).
if [ "$(id -u)" = 0 ] && have apt-get; then
  missing=()
  have dockerd || missing+=(docker.io)
  have debootstrap || missing+=(debootstrap)
  have docker-compose || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq >/dev/null || fail "apt-get update failed"
    apt_install "${missing[@]}" || fail "apt-get install ${missing[*]} failed"
  fi
  { have docker && plugins_ok; } || install_plugins_from_trixie
fi
if ! { have docker && plugins_ok; }; then
  [ "$(id -u)" = 0 ] || fail "not root: cannot install Docker (the engine and the Compose v2 and buildx plugins)"
  fail "no apt-get: cannot install Docker (the engine and the Compose v2 and buildx plugins)"
fi
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "no Docker engine answers (docker info fails), and starting one needs root"
  have dockerd || fail "no dockerd on PATH"
  start_dockerd
fi
echo "docker-setup: $(docker compose version), engine $(docker version -f '{{.Server.Version}}')"
