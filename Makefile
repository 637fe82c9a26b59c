# The two front-door commands: `make demo` (a small real training job on CPU) and `make test`.
# Both create a local virtual environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4

.PHONY: venv demo test test-variants lint gpu-check gpu-check-cpu bench clean

$(VENV)/.installed: setup.py pyproject.toml megatron/data/helpers.cpp megatron/planner/dynapipe/partition.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q pybind11 pytest pytest-timeout tensorboard ruff
	$(PY) -m pip install -q --no-build-isolation -e ".[test,tensorboard,convert,experiments]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash examples/demo_cpu.sh $(NPROC)

# The package's lint rules (pyproject.toml [tool.ruff]).
lint: venv
	$(PY) -m ruff check megatron

test: venv
	$(PY) -m megatron.fused_kernels --allow-fallback
	$(PY) -m pytest -q tests

# The parity tests again under the CPU code paths another machine may take: the portable
# (non-AVX) kernels with two OpenMP threads, then PyTorch's ops instead of the fused kernels.
# Their tolerances are derived (tests/parity_utils.py), so they must hold on every path.
PARITY := -m "parity and not slow"
test-variants: venv
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=2 $(PY) -m pytest -q $(PARITY) tests
	MEGATRON_NO_FUSED_KERNELS=1 $(PY) -m pytest -q $(PARITY) tests

# One command for a GPU box (benchmarks/gpu_check.py; under 8 minutes on one CUDA device): the
# cuda-marked tests, bench_gpu.py's step rows, bench_kernels.py's attention rows and a flash-attention
# cost table, into docs/gpu_check.{json,md}. It uses the Python that has CUDA torch (GPU_PYTHON, default
# the venv's if there is one, else python3): a GPU image brings its own torch, and `make venv` would
# fetch another. gpu-check-cpu is its CPU form (CI runs it): small sizes, CUDA-only parts skipped.
GPU_PYTHON ?= $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

gpu-check-cpu:
	$(GPU_PYTHON) benchmarks/gpu_check.py --cpu

clean:
	rm -rf $(VENV) build *.egg-info megatron/data/*.so megatron/fused_kernels/build
