"""CUDA kernels: nvcc compile-check of the raw-pointer templates (works with CPU-only torch), and
parity against the CPU kernels / eager references when a GPU is present."""
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megatron import fused_kernels

CUH = Path(fused_kernels.__file__).parent / "csrc" / "cuda" / "fused_kernels.cuh"

# Instantiates every launcher (hence every kernel) for every element type.
CHECK_TU = r"""
#include "{cuh}"
namespace megatron_fused {{
#define INST(T) \
  template cudaError_t launch_softmax_forward<T>(const T*, const bool*, T*, int64_t, int64_t, int64_t, int64_t, \
                                                 int64_t, double, bool, cudaStream_t); \
  template cudaError_t launch_softmax_backward<T>(const T*, const T*, T*, int64_t, int64_t, double, cudaStream_t); \
  template cudaError_t launch_bias_gelu<T>(const T*, const T*, const T*, T*, int64_t, int64_t, bool, cudaStream_t); \
  template cudaError_t launch_bias_dropout_add<T>(const T*, const T*, const T*, const bool*, T*, int64_t, int64_t, \
                                                  double, cudaStream_t); \
  template cudaError_t launch_dropout_backward<T>(const T*, const bool*, T*, int64_t, double, cudaStream_t); \
  template cudaError_t launch_varlen_forward<T>(const T*, const T*, const T*, T*, Acc<T>::type*, \
                                                const VarlenParams&, cudaStream_t); \
  template cudaError_t launch_varlen_backward<T>(const T*, const T*, const T*, const T*, const T*, \
                                                 const Acc<T>::type*, T*, Acc<T>::type*, Acc<T>::type*, \
                                                 const VarlenParams&, cudaStream_t);
INST(float)
INST(double)
INST(__half)
INST(__nv_bfloat16)
}}
"""


def _nvcc():
    """nvcc on PATH, in /usr/local/cuda, or in the environment `make cuda-build` caches."""
    cached = sorted(Path(os.environ.get("MEGATRON_CUDA_ENV", Path.home() / ".cache" / "megatron-cuda-env"))
                    .glob("*/cuda_home/bin/nvcc"))
    return (shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
            or (str(cached[-1]) if cached else None))


def _torch_nvcc_flags():
    """The defines torch's extension build gives nvcc (-D__CUDA_NO_HALF_OPERATORS__,
    -D__CUDA_NO_HALF_CONVERSIONS__, -D__CUDA_NO_BFLOAT16_CONVERSIONS__, ...): the kernels must
    compile under them, as they do in every user's build."""
    from torch.utils import cpp_extension
    return list(cpp_extension.COMMON_NVCC_FLAGS)


@pytest.mark.cuda
@pytest.mark.skipif(not _nvcc(), reason="nvcc not found (install the CUDA toolkit to compile-check the CUDA kernels)")
def test_cuda_kernel_templates_compile_with_nvcc():
    """Front end + NVVM for sm_80 PTX (no ptxas, to keep the test short). A passing result is
    cached by the hash of the kernel file, this test and nvcc's version, like ccache would."""
    nvcc = _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    src = CHECK_TU.format(cuh=CUH)
    headers = CUH.read_text() + (CUH.parents[1] / "common" / "fused_math.h").read_text()
    flags = _torch_nvcc_flags()
    key = hashlib.sha256((headers + src + version + " ".join(flags)).encode()).hexdigest()[:16]
    out = fused_kernels.cache_dir() / "nvcc_check"
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / f"{key}.ok"
    if stamp.exists():
        return
    tu = out / f"check_{key}.cu"
    tu.write_text(src)
    r = subprocess.run([nvcc, "-std=c++17", *flags, "-arch=compute_80", "-code=compute_80", "-c", str(tu), "-o",
                        str(out / f"check_{key}.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-4000:]
    stamp.write_text("ok\n")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CUDA parity runs on a GPU box)")


@pytest.mark.cuda
@needs_cuda
def test_cuda_kernels_match_cpu_kernels():
    from megatron.fused_kernels import ops
    if not fused_kernels.has_cuda_kernels():
        pytest.fail(f"CUDA available but the extension has no CUDA kernels: {fused_kernels.unavailable_reason()}")
    dev = torch.device("cuda")

    def both(fn, *xs):
        cpu = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
        gpu = [x.detach().to(dev).requires_grad_(x.is_floating_point()) for x in xs]
        oc, og = fn(*cpu), fn(*gpu)
        g = torch.randn_like(oc)
        oc.backward(g)
        og.backward(g.to(dev))
        torch.testing.assert_close(og.cpu(), oc, rtol=1e-4, atol=1e-5)
        for a, b in zip(gpu, cpu):
            if b.grad is not None:
                torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5)

    x = torch.randn(2, 3, 37, 37)
    mask = torch.rand(1, 1, 37, 37) < 0.3
    mask[..., 5, :] = True
    both(lambda t: ops.scaled_upper_triang_masked_softmax(t, 0.6, fused=True), x)
    both(lambda t: ops.scaled_masked_softmax(t, mask.to(t.device), 0.6, fused=True), x)
    both(lambda b, t: ops.bias_gelu(b, t, fused=True), torch.randn(40), torch.randn(3, 5, 40))
    cu_q, cu_k = torch.tensor([0, 5, 6, 30, 30]), torch.tensor([0, 7, 9, 30, 31])
    q, k, v = torch.randn(30, 2, 72), torch.randn(31, 2, 72), torch.randn(31, 2, 72)
    for causal in (True, False):
        for p in (0.0, 0.2):  # the dropout hash is shared, so CPU and CUDA drop the same entries
            both(lambda a, b, c: ops.varlen_attention(a, b, c, cu_q, cu_k, causal=causal, dropout_p=p, seed=3,
                                                      fused=True), q, k, v)


@pytest.mark.slow
@pytest.mark.skipif(not _nvcc(), reason="nvcc not found")
def test_aten_cuda_launchers_compile_with_nvcc(tmp_path):
    """The thin ATen launcher file, compiled by nvcc against this torch's headers (~1 min CPU, so
    slow-marked). A CPU wheel lacks the CMake-generated c10/cuda config header; a one-line stand-in
    supplies it. Nothing is linked or run."""
    from torch.utils import cpp_extension
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    src = CUH.parent / "fused_kernels_cuda.cu"
    includes = [f"-I{tmp_path}"] + [f"-I{p}" for p in cpp_extension.include_paths()]
    r = subprocess.run([_nvcc(), "-std=c++17", *_torch_nvcc_flags(), "-arch=compute_80", "-code=compute_80", *includes,
                        "-c", str(src),
                        "-o", str(tmp_path / "launchers.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
