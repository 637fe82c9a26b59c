# The two front-door commands: `make demo` (a small real training job on CPU) and `make test`.
# Both create a local virtual environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4

.PHONY: venv demo test test-variants lint docs gpu-check gpu-check-cpu cuda-build bench clean

# Each step says what it does before it starts (the first install takes minutes: PyTorch's CPU
# wheel is ~200 MB); pip's own progress bars stay on for the downloads. `make demo` needs only
# PyTorch and this package (.installed-run); `make venv` / `make test` add the test, docs,
# conversion and plotting tools on top (.installed).
CXX_SOURCES := megatron/data/helpers.cpp megatron/planner/dynapipe/partition.cpp
$(VENV)/.installed-run: setup.py pyproject.toml $(CXX_SOURCES)
	@echo "== [venv 1/3] creating $(VENV) (once)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@echo "== [venv 2/3] installing $(TORCH_SPEC) (CPU wheel, ~200 MB download)"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	@echo "== [venv 3/3] building the C++ helpers (data index, planner partitioner) and installing this package"
	$(PY) -m pip install --progress-bar on pybind11 tensorboard
	$(PY) -m pip install --progress-bar on --no-build-isolation -e ".[tensorboard]"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-run
	@echo "== [venv +1] adding the test, lint, conversion, plotting and docs tools (transformers, matplotlib, mkdocs)"
	$(PY) -m pip install --progress-bar on pytest pytest-timeout ruff
	$(PY) -m pip install --progress-bar on --no-build-isolation -e ".[test,tensorboard,convert,experiments,docs]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed-run
	@echo "== fused CPU kernels: built once per machine (about 30 s on 2 idle cores), then cached"
	$(PY) -m megatron.fused_kernels --allow-fallback
	bash examples/demo_cpu.sh $(NPROC)

# The docs/ site (mkdocs.yml: every docs/*.md page, no nav to keep up) into site/; --strict turns a
# broken link or a missing page into a failure. tests/test_docs_commands.py runs the pages' commands.
docs: venv
	$(PY) -m mkdocs build --strict --quiet --site-dir site

# The package's lint rules (pyproject.toml [tool.ruff]).
lint: venv
	$(PY) -m ruff check megatron

test: venv
	$(PY) -m megatron.fused_kernels --allow-fallback
	$(PY) -m pytest -q tests

# The parity tests again under the CPU code paths another machine may take: every
# ATEN_CPU_CAPABILITY this CPU can run (tools/cpu_capabilities.sh: default, avx2, avx512; the
# portable one with two OpenMP threads), then PyTorch's ops instead of the fused kernels. They run
# in float64 with bounds no summation order can reach (tests/parity_utils.py), so they must hold
# on every path; a capability the CPU lacks is skipped (forcing it would crash, not test).
# CAPS=--skip-native leaves out the capability `make test` just ran (.ci/run does).
PARITY := -m "parity and not slow"
CAPS ?=
test-variants: venv
	@set -e; for cap in $$(sh tools/cpu_capabilities.sh $(CAPS)); do \
	  echo "== parity tests, ATEN_CPU_CAPABILITY=$$cap"; \
	  if [ "$$cap" = default ]; then threads=2; else threads=$${OMP_NUM_THREADS:-1}; fi; \
	  ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=$$threads $(PY) -m pytest -q $(PARITY) tests; \
	done
	@echo "== parity tests, MEGATRON_NO_FUSED_KERNELS=1"
	MEGATRON_NO_FUSED_KERNELS=1 $(PY) -m pytest -q $(PARITY) tests

# One command for a GPU box (benchmarks/gpu_check.py; at most 570 s, parts with their own budgets):
# the cuda-marked tests, bench_gpu.py's step rows, bench_kernels.py's attention rows, a flash-attention
# cost table, PP 2 schedules by the clock and CP 2 memory (2 GPUs), MFU of GPT-1.3B at TP 1/2/4 and
# DynaPipe's predicted vs measured step (docs/gpu.md), into docs/gpu_check.{json,md}. It uses the Python that has CUDA torch (GPU_PYTHON, default
# the venv's if there is one, else python3): a GPU image brings its own torch, and `make venv` would
# fetch another. gpu-check-cpu is its CPU form (CI runs it): small sizes, CUDA-only parts skipped.
GPU_PYTHON ?= $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

gpu-check-cpu:
	$(GPU_PYTHON) benchmarks/gpu_check.py --cpu

# The CUDA kernels compiled on this (CPU) machine as a GPU user's first run compiles them: the CUDA
# build of torch and the registry's nvcc, torch's own extension flags, sm_80 + sm_90
# (tools/cuda_build_check.sh; its ~3 GB environment is cached in ~/.cache/megatron-cuda-env).
# Warnings are shown; a compile error fails. CUDA_ARCHS="8.0;9.0;10.0" adds Blackwell.
CUDA_ARCHS ?= 8.0;9.0
cuda-build:
	TORCH_CUDA_ARCH_LIST="$(CUDA_ARCHS)" bash tools/cuda_build_check.sh

clean:
	rm -rf $(VENV) site build *.egg-info megatron/data/*.so megatron/fused_kernels/build
