# Two entry points: `make quickstart` and `make test` (see README.md).
# VENV can point at an existing environment (e.g. one with a CUDA torch): make test VENV=/path/to/venv
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.rlcli-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install quickstart test test-fast test-gpu clean

$(PY):
	python3 -m venv $(VENV)

# torch==2.13.0 is the CPU build this machine kind keeps on disk; an environment that already
# has a torch (say a CUDA build on a GPU box) keeps it.
$(STAMP): pyproject.toml plugins/rlcli-math-verify/pyproject.toml plugins/rlcli-python-tool/pyproject.toml \
		plugins/rlcli-vllm/pyproject.toml plugins/rlcli-sglang/pyproject.toml plugins/rlcli-lmdeploy/pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev]"
	$(PIP) install -e ./plugins/rlcli-math-verify
	$(PIP) install -e ./plugins/rlcli-python-tool
	$(PIP) install -e ./plugins/rlcli-vllm -e ./plugins/rlcli-sglang -e ./plugins/rlcli-lmdeploy
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/rlcli train recipes/quickstart.yaml

# The CPU suite runs in PYTEST_WORKERS processes (pytest-xdist), each taking whole test files, so
# a file's module fixtures are built once: on 2 cores, ~40 % less wall time than one process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(XDIST) -m "not gpu" tests plugins/rlcli-math-verify/tests plugins/rlcli-python-tool/tests plugins/rlcli-vllm/tests plugins/rlcli-sglang/tests plugins/rlcli-lmdeploy/tests

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not gpu and not slow" tests plugins/rlcli-math-verify/tests plugins/rlcli-python-tool/tests plugins/rlcli-vllm/tests plugins/rlcli-sglang/tests plugins/rlcli-lmdeploy/tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf work_dirs .pytest_cache build dist *.egg-info
