"""The JIT loader: fallback when the compiler is missing, local ranks > 0 waiting for rank 0."""
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron import fused_kernels

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import torch, torch.nn.functional as F
from megatron import fused_kernels
from megatron.fused_kernels import ops
x, b = torch.randn(3, 8), torch.randn(8)
y = ops.bias_gelu(b, x)
torch.testing.assert_close(y, F.gelu(x + b, approximate="tanh"))
seg = torch.tensor([[1, 1, 2, 0]])
q = torch.randn(4, 2, 4)
o = ops.varlen_attention(q, q, q, ops.cu_seqlens_from_segment_ids(seg))
s = ops.scaled_masked_softmax(torch.randn(1, 1, 2, 2), torch.tensor([[[[True, False], [True, True]]]]), 1.0)
assert torch.isfinite(o).all() and s[0, 0, 1].eq(0).all()
print("LOADED", fused_kernels.load())
"""


def _run(env_extra, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_missing_compiler_warns_once_and_falls_back(tmp_path):
    r = _run({"CXX": "/nonexistent/c++", "MEGATRON_FUSED_KERNELS_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "LOADED False" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "fused kernels unavailable" in line]
    assert len(warnings) == 1 and "/nonexistent/c++" in warnings[0] and "PyTorch fallback" in warnings[0]


def test_other_local_ranks_wait_for_rank0_build_without_a_compiler(tmp_path):
    """LOCAL_RANK=1 never compiles: it waits for rank 0's stamp, then loads the shared library."""
    if not fused_kernels.load():
        pytest.skip("extension not built here")
    name = fused_kernels.build_key(fused_kernels._with_cuda())
    built = fused_kernels.cache_dir() / name / f"{name}.so"

    def rank0():
        time.sleep(1.5)
        (tmp_path / name).mkdir()
        shutil.copy(built, tmp_path / name / built.name)
        (tmp_path / f"{name}.ok").write_text("ok\n")

    t = threading.Thread(target=rank0)
    t.start()
    start = time.time()
    r = _run({"CXX": "/nonexistent/c++", "MEGATRON_FUSED_KERNELS_DIR": str(tmp_path), "LOCAL_RANK": "1"})
    t.join()
    assert r.returncode == 0, r.stderr
    assert "LOADED True" in r.stdout and "unavailable" not in r.stderr
    assert time.time() - start >= 1.5


def test_wait_reports_rank0_failure_and_timeout(tmp_path, monkeypatch):
    (tmp_path / "ext.failed").write_text("RuntimeError: boom\n")
    with pytest.raises(RuntimeError, match="boom"):
        fused_kernels._wait_for_rank0(tmp_path, "ext")
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_WAIT", "0.3")
    with pytest.raises(TimeoutError, match="MEGATRON_FUSED_KERNELS_WAIT"):
        fused_kernels._wait_for_rank0(tmp_path, "other")
