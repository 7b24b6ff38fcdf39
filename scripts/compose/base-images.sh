#!/usr/bin/env bash
# Stand-ins for the compose file's public base images, for machines that reach Debian's
# package mirror but no image registry: python:3.11-slim is made from Debian bookworm's
# packages with debootstrap and `docker import`ed, redis:7-alpine is that image plus
# redis-server, under the names given (BASE_IMAGE, REDIS_IMAGE). Python is bookworm's 3.11;
# redis-server is bookworm's 7.0.
# An image that is already there is kept (delete it to rebuild).
#
#   scripts/compose/base-images.sh conveyor-ci/python:3.11 conveyor-ci/redis:7
set -euo pipefail

python_image=${1:?usage: base-images.sh PYTHON_IMAGE REDIS_IMAGE}
redis_image=${2:?usage: base-images.sh PYTHON_IMAGE REDIS_IMAGE}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

# make_image NAME PACKAGES CHANGE...: a minbase bookworm with PACKAGES, imported as NAME
make_image() {
  local name=$1 packages=$2
  shift 2
  if docker image inspect "$name" >/dev/null 2>&1; then
    echo "base-images: $name is there"
    return
  fi
  local root
  root=$(mktemp -d /var/tmp/conveyor-rootfs.XXXXXX)
  echo "base-images: debootstrap bookworm + $packages -> $name"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -20 "$root.log"; rm -rf "$root" "$root.log"; return 1; }
  # what an image needs no copy of: apt's lists, docs, man pages, caches
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  local changes=()
  for c in "$@"; do changes+=(--change "$c"); done
  tar -C "$root" --numeric-owner -c . | docker import "${changes[@]}" - "$name" >/dev/null
  rm -rf "$root" "$root.log"
  echo "base-images: $name: $(docker image inspect -f '{{.Size}}' "$name" | numfmt --to=si)B"
}

# python:3.11-slim: python/python3 on PATH, venv, CA certificates, UTF-8 locale
make_image "$python_image" python3,python3-venv,python-is-python3,ca-certificates \
  'ENV LANG=C.UTF-8' 'CMD ["python3"]'
# redis:7-alpine: redis-server and redis-cli on PATH, /data as the working directory; on
# top of the python stand-in (one debootstrap, not two: it is the slow part)
if docker image inspect "$redis_image" >/dev/null 2>&1; then
  echo "base-images: $redis_image is there"
else
  echo "base-images: $python_image + redis-server -> $redis_image"
  docker build -q -t "$redis_image" - >/dev/null <<DOCKERFILE
FROM $python_image
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
WORKDIR /data
CMD ["redis-server"]
DOCKERFILE
fi
