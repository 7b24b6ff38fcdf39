# Conveyor image: one image for every role (api, flower, worker pools).
#
#   CPU (default):  docker build -t conveyor:latest .
#   GPU (CUDA 12.8): docker build -t conveyor:gpu \
#                      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                      --build-arg EXTRAS=model,nixl,vllm .
#   (the `vllm` extra installs vLLM with the CUDA torch it pins, for --engine vllm)
#
# The role is chosen by the command, e.g. `conveyor api --host 0.0.0.0 --port 8000`,
# `conveyor worker --pool generate`, `conveyor flower --host 0.0.0.0 --port 5555`.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=model,nixl

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# torch first, pinned, from the CPU (or CUDA) wheel index. pyproject.toml only asks for
# torch>=2.4, so the project install below reuses this build instead of pulling a CUDA
# wheel from PyPI. Kept in its own layer: it is the largest and changes least.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# A C compiler for the reference engine's decode-attention kernel, which each worker builds
# for its host's CPU on first use (workers/paged_kernel.py); without it, torch's slower path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid conveyor --create-home --home-dir /home/conveyor \
       --shell /usr/sbin/nologin conveyor

WORKDIR /app

COPY pyproject.toml README.md ./
COPY api/ api/
COPY tasks/ tasks/
COPY workers/ workers/
COPY kvbm/ kvbm/
# NIXL where its wheel installs (KV transfer without Redis in between), else without it;
# EXTRAS adds vllm on the GPU image
RUN pip install --no-cache-dir ".[${EXTRAS}]" || pip install --no-cache-dir ".[model]"

# The default checkpoint is generated at build time (no network needed at run time),
# by the unprivileged user so the files belong to it.
RUN mkdir -p /models && chown conveyor:conveyor /models
USER conveyor
RUN conveyor model init /models/tiny-llava
ENV CONVEYOR_MODEL=/models/tiny-llava

# 8000: OpenAI-compatible API; 5555: Flower.
EXPOSE 8000 5555

CMD ["conveyor", "api", "--host", "0.0.0.0", "--port", "8000"]
