"""The JIT loader: fallback when the compiler is missing, local ranks > 0 waiting for rank 0."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron import fused_kernels

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import torch, torch.nn.functional as F
from megatron import fused_kernels
from megatron.fused_kernels import ops
print("WAITING", flush=True)  # the first op below loads (or waits for) the extension
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


def _start(env_extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Both loader scenarios run as concurrent subprocesses (each pays a torch import):
    'missing': no compiler, empty cache -> fallback; 'rank1': LOCAL_RANK=1, no compiler, rank 0's
    build appears in its cache after 1.5 s -> it waits, then loads the library."""
    missing_dir, rank1_dir = tmp_path_factory.mktemp("missing"), tmp_path_factory.mktemp("rank1")
    start = None
    procs = {"missing": _start({"CXX": "/nonexistent/c++", "MEGATRON_FUSED_KERNELS_DIR": str(missing_dir)})}
    built = None
    if fused_kernels.load():
        name = fused_kernels.build_key(fused_kernels._with_cuda())
        built = fused_kernels.cache_dir() / name / f"{name}.so"
        procs["rank1"] = _start({"CXX": "/nonexistent/c++", "MEGATRON_FUSED_KERNELS_DIR": str(rank1_dir),
                                 "LOCAL_RANK": "1"})
        # "rank 0" finishes its build only once rank 1 is already inside load()
        line = procs["rank1"].stdout.readline()
        assert line.startswith("WAITING"), line
        start = time.time()
        time.sleep(1.0)
        (rank1_dir / name).mkdir()
        shutil.copy(built, rank1_dir / name / built.name)
        (rank1_dir / f"{name}.ok").write_text("ok\n")
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        out[k] = (p.returncode, stdout, stderr, time.time() - start if k == "rank1" else None)
    return out


def test_missing_compiler_warns_once_and_falls_back(probes):
    rc, stdout, stderr, _ = probes["missing"]
    assert rc == 0, stderr
    assert "LOADED False" in stdout
    warnings = [line for line in stderr.splitlines() if "fused kernels unavailable" in line]
    assert len(warnings) == 1 and "/nonexistent/c++" in warnings[0] and "PyTorch fallback" in warnings[0]


def test_other_local_ranks_wait_for_rank0_build_without_a_compiler(probes):
    """LOCAL_RANK=1 never compiles: it waits for rank 0's stamp, then loads the shared library."""
    if "rank1" not in probes:
        pytest.skip("extension not built here")
    rc, stdout, stderr, elapsed = probes["rank1"]
    assert rc == 0, stderr
    assert "LOADED True" in stdout and "unavailable" not in stderr
    assert elapsed >= 1.0


def test_wait_reports_rank0_failure_and_timeout(tmp_path, monkeypatch):
    (tmp_path / "ext.failed").write_text("RuntimeError: boom\n")
    with pytest.raises(RuntimeError, match="boom"):
        fused_kernels._wait_for_rank0(tmp_path, "ext")
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_WAIT", "0.3")
    with pytest.raises(TimeoutError, match="MEGATRON_FUSED_KERNELS_WAIT"):
        fused_kernels._wait_for_rank0(tmp_path, "other")
