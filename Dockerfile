# Conveyor image: one image for every role (api, flower, worker pools). Needs BuildKit
# (Compose v2, `docker buildx build`, or DOCKER_BUILDKIT=1): RUN --mount.
#
#   CPU (default):   docker buildx build -t conveyor:latest .
#   GPU (CUDA 12.8): docker buildx build -t conveyor:gpu \
#                      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                      --build-arg EXTRAS=model,vllm --build-arg NIXL_CUDA=cu12 .
#   (the `vllm` extra installs vLLM with the CUDA torch it pins, for --engine vllm)
#
# Everything that depends on where it is built is a build argument (docs/operations.md, "Deploy with
# Docker Compose"): BASE_IMAGE; torch's version and index; the index for everything else,
# an extra index and a folder of wheels inside the build context (WHEELS_DIR; with both
# indexes `none`, a build without network); pip's CA bundle is a build secret (id pip_ca),
# never a layer:
#   docker buildx build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt .
#
# The role is chosen by the command, e.g. `conveyor api --host 0.0.0.0 --port 8000`,
# `conveyor worker --pool generate`, `conveyor flower --host 0.0.0.0 --port 5555`.
ARG BASE_IMAGE=python:3.11-slim

# ------------------------------------------------------------------------ builder
# The virtual environment, the decode kernel and the default model; only what they make
# goes on to the runtime stage (no compiler, no pip cache, no wheels).
FROM ${BASE_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG INDEX_URL=https://pypi.org/simple
ARG EXTRA_INDEX_URL=
ARG WHEELS_DIR=
ARG EXTRAS=model
# NIXL for one CUDA major (cu12 or cu13), matching the torch build; empty: none (KV moves
# through Redis, as it does between containers without shared IPC or RDMA anyway)
ARG NIXL_CUDA=
ARG NIXL_VERSION=1.5.1

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

# The C compiler for the decode-attention kernel, here only (from apt unless the base
# image has one).
RUN command -v cc >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*; }

RUN python -m venv /opt/venv

# The wheels folder alone, when WHEELS_DIR names one (no match: nothing is copied). Only its
# content, not the rest of the context, is part of the installs' cache keys below.
COPY ${WHEELS_DIR:-no-wheels}* /wheels/

# `pip-install INDEX ARGS...`: pip install from INDEX (`none`: no index, the wheels only)
# with the other build arguments' options; the CA secret is at /run/secrets/pip_ca.
RUN printf '%s\n' '#!/bin/sh' \
      'index=$1; shift' \
      'if [ "$index" = none ]; then set -- --no-index "$@"; else set -- --index-url "$index" "$@"; fi' \
      '[ -s /run/secrets/pip_ca ] && export PIP_CERT=/run/secrets/pip_ca' \
      'exec pip install --no-cache-dir ${EXTRA_INDEX_URL:+--extra-index-url "$EXTRA_INDEX_URL"} \' \
      '  ${WHEELS_DIR:+--find-links /wheels} "$@"' \
      > /usr/local/bin/pip-install \
    && chmod +x /usr/local/bin/pip-install

# torch first, pinned, from the CPU (or CUDA) wheel index: pyproject.toml only asks for
# torch>=2.4, so the installs below keep this build instead of PyPI's CUDA one. Its C++
# headers and C++ test binaries (about 145 MB) serve no Python import: dropped.
RUN --mount=type=secret,id=pip_ca \
    pip-install "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && rm -rf /opt/venv/lib/python3*/site-packages/torch/include \
              /opt/venv/lib/python3*/site-packages/torch/test

# The dependencies, from pyproject.toml alone (no packages yet: an empty `conveyor`), so
# that a change to the code or the README reinstalls only the project itself.
WORKDIR /src
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip_ca \
    touch README.md \
    && pip-install "${INDEX_URL}" ".[${EXTRAS}]" \
    && if [ -n "${NIXL_CUDA}" ]; then \
         pip-install "${INDEX_URL}" "nixl-${NIXL_CUDA}==${NIXL_VERSION}" \
         && pip-install "${INDEX_URL}" --no-deps "nixl==${NIXL_VERSION}"; \
       fi

# Structured outputs (workers/structured.py): xgrammar without triton, which it asks for
# only for its CUDA bitmask kernel (~1 GB; the engine masks with xgrammar's C++ kernel on
# CPU and torch elsewhere); its other requirements are installed above or here.
ARG XGRAMMAR_VERSION=0.2.8
RUN --mount=type=secret,id=pip_ca \
    pip-install "${INDEX_URL}" "apache-tvm-ffi>=0.1.11" \
    && pip-install "${INDEX_URL}" --no-deps "xgrammar==${XGRAMMAR_VERSION}"

COPY README.md ./
COPY api/ api/
COPY tasks/ tasks/
COPY workers/ workers/
COPY kvbm/ kvbm/
COPY cluster/ cluster/
COPY planner/ planner/
RUN --mount=type=secret,id=pip_ca pip-install "${INDEX_URL}" --no-deps .

# The decode kernel, built by the worker's own code (workers/paged_kernel.py) into
# CONVEYOR_KERNEL_DIR. It is compiled with -march=native for the CPU that builds the image,
# and found by a name that hashes the source, the flags, the compiler's version line and
# the CPU: the runtime stage has no compiler, so `cc` there is a stand-in that answers
# --version with this compiler's line and refuses to compile. On the build host's CPU (the
# `docker compose up --build` case) the worker loads this copy; on another CPU the name
# differs, the stand-in refuses, and the engine falls back to torch's path (never runs
# instructions the CPU lacks).
ENV CONVEYOR_KERNEL_DIR=/opt/conveyor/kernels
RUN python -c "from tasks.settings import Settings; from workers import paged_kernel; \
    paged_kernel.load(Settings().engine.kernel_path())" \
    && mkdir -p /opt/conveyor/bin \
    && cc --version | head -n 1 > /opt/conveyor/kernels/cc-version \
    && printf '%s\n' '#!/bin/sh' \
      '# No C compiler in this image: the decode kernel was built with the image.' \
      'if [ "$1" = --version ]; then cat /opt/conveyor/kernels/cc-version; exit 0; fi' \
      'echo "no C compiler in this image: its decode kernel was built for the CPU of the" \' \
      '  "host that built it; rebuild the image on this host to use the kernel here" >&2' \
      'exit 1' > /opt/conveyor/bin/cc \
    && chmod +x /opt/conveyor/bin/cc

# The default checkpoint is generated at build time: no network needed at run time.
RUN conveyor model init /models/tiny-llava

# ------------------------------------------------------------------------ runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    CC=/opt/conveyor/bin/cc \
    CONVEYOR_KERNEL_DIR=/opt/conveyor/kernels \
    CONVEYOR_MODEL=/models/tiny-llava

RUN groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid conveyor --create-home --home-dir /home/conveyor \
       --shell /usr/sbin/nologin conveyor

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/conveyor /opt/conveyor
COPY --from=builder --chown=conveyor:conveyor /models /models

USER conveyor
WORKDIR /home/conveyor

# 8000: OpenAI-compatible API; 5555: Flower.
EXPOSE 8000 5555

CMD ["conveyor", "api", "--host", "0.0.0.0", "--port", "8000"]
