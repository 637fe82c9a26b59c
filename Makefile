# The two front-door commands: `make demo` (a small real training job on CPU) and `make test`.
# Both create a local virtual environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4

.PHONY: venv demo test test-variants lint bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info megatron/data/*.so megatron/fused_kernels/build
