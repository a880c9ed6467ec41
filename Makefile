# The torch wheel for this CPU machine lies on disk; any other spec pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The Hugging Face models the tests run: transformers 5.25 makes the `kernels` package a
# dependency whose layer wrapper mutates a global inside a checkpointed forward, and Dynamo
# then graph-breaks a Mixtral layer's region (it runs through the eager runtime instead);
# the suite pins the last release without it (users keep pyproject's `transformers>=4.40`).
TRANSFORMERS_SPEC ?= transformers>=4.40,<5.25
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow demo bench fuzz gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,report,integrations]" "$(TRANSFORMERS_SPEC)"
	touch $(STAMP)

# The quick suite; the slow tail (100k-op chain, 1,000-step leak runs, Inductor
# end-to-end extras) is `make test-slow`. CI runs both.
test: setup
	$(PY) -m pytest -q -m "not slow" tests

test-slow: setup
	$(PY) -m pytest -q -m slow tests

demo: setup
	$(PY) -m sac_compile.demo

bench: setup
	$(PY) benchmarks/eager_overhead.py
	$(PY) benchmarks/partition.py
	$(PY) benchmarks/pareto.py --quick
	$(PY) benchmarks/offload.py
	$(PY) benchmarks/peak.py --inductor
	$(PY) benchmarks/peak_hf.py
	$(PY) benchmarks/peak_measured.py
	$(PY) benchmarks/step_budget.py --plot
	$(PY) benchmarks/step_budget.py --compiler eager
	$(PY) benchmarks/step_budget.py --compile-blocks

# The GPU check (issue 21): CUDA tests, a Llama-style step per strategy, offload rows and
# eager overhead, in under 8 minutes; writes $(GPU_CHECK_OUT)/gpu_check.{md,json}. Needs
# only torch (+ numpy, scipy, pytest for the tests), so no setup: on a CUDA machine run
# `PYTHONPATH=. python benchmarks/gpu_check.py --out DIR`. GPU_CHECK_ARGS='--device cpu
# --quick' runs the same harness at tiny sizes on the CPU.
GPU_CHECK_OUT ?= gpu_check_out
GPU_CHECK_PY ?= $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_CHECK_PY) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# >= 2,000 random programs (eager and compiled) against no checkpointing; prints counts and,
# on a failure, a shrunk standalone repro.
fuzz: setup
	$(PY) tests/fuzzlib/run.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
