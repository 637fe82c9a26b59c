"""Fused C++/CUDA kernels, built on first use (like Megatron-LM's `fused_kernels.load()`).

`load()` JIT-compiles `csrc/cpu/*.cpp` (plus `csrc/cuda/*.cu` when torch has CUDA) with
`torch.utils.cpp_extension` into a cache directory and registers the ops as
`torch.ops.megatron_fused.*`. The build is keyed by a hash of the sources, flags and torch
version, so one build per machine is reused by every later process; the local rank 0 of each
node builds while the other local ranks wait for its stamp file. When the compiler or headers
are missing, or the build fails, one warning line is printed and every op in
`megatron.fused_kernels.ops` runs its PyTorch fallback instead.

Environment:
  MEGATRON_FUSED_KERNELS_DIR   cache directory (default: megatron/fused_kernels/build)
  MEGATRON_NO_FUSED_KERNELS=1  never build; always use the PyTorch fallback
  MEGATRON_FUSED_KERNELS_CUDA=1  build the CUDA kernels without a visible GPU (a CUDA torch and
                               nvcc are still needed; set TORCH_CUDA_ARCH_LIST): image builds
  MEGATRON_FUSED_KERNELS_WAIT  seconds to wait for another process's build: a non-zero local rank for
                               rank 0's, a second launch for the first's (default 900)
  CXX                          the C++ compiler (default c++), as for any torch extension
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

from megatron.fused_kernels import build_lock

_HERE = Path(__file__).resolve().parent
CPU_SOURCES = sorted((_HERE / "csrc" / "cpu").glob("*.cpp"))
CUDA_SOURCES = sorted((_HERE / "csrc" / "cuda").glob("*.cu"))
CUDA_HEADERS = sorted((_HERE / "csrc" / "cuda").glob("*.cuh"))
COMMON_HEADERS = sorted((_HERE / "csrc" / "common").glob("*.h"))  # formulas shared by CPU and CUDA

_state: dict = {"loaded": None, "warned": False, "reason": None}


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_FUSED_KERNELS_DIR") or _HERE / "build")


def _cpu_flags() -> list[str]:
    # OpenMP for at::parallel_for (torch already loads its runtime); no FMA contraction, so
    # elementwise kernels round exactly as the eager ops they replace; no trapping math / errno so
    # float compares and selects if-convert and the row loops vectorise (results are unchanged)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = ""
        if " avx2" in info and " fma" in info:
            flags += ["-mavx2", "-mfma"]
    return flags


def _with_cuda() -> bool:
    import torch
    from torch.utils import cpp_extension
    wanted = torch.cuda.is_available() or (os.environ.get("MEGATRON_FUSED_KERNELS_CUDA") == "1"
                                           and torch.version.cuda is not None)
    return bool(wanted and CUDA_SOURCES and cpp_extension.CUDA_HOME)


def build_key(with_cuda: bool) -> str:
    """Extension name: changes whenever a source, a flag or the torch build changes."""
    import torch
    h = hashlib.sha256()
    for p in CPU_SOURCES + COMMON_HEADERS + (CUDA_SOURCES + CUDA_HEADERS if with_cuda else []):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(_cpu_flags()).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    if with_cuda:  # a build for other GPU architectures is another extension
        h.update(os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
    return f"megatron_fused_{'cuda' if with_cuda else 'cpu'}_{h.hexdigest()[:12]}"


def _warn(reason: str) -> None:
    _state["reason"] = reason
    if not _state["warned"]:
        _state["warned"] = True
        print(f"WARNING: megatron fused kernels unavailable ({reason}); using the PyTorch fallback", file=sys.stderr,
              flush=True)


def _compiler_missing() -> Optional[str]:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"C++ compiler {cxx!r} not found: install g++ or set CXX"
    return None


def _library_path(build_dir: Path, name: str) -> Path:
    return build_dir / name / f"{name}.so"


def _build(name: str, with_cuda: bool, verbose: bool) -> Path:
    from torch.utils import cpp_extension
    out = cache_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    sources = [str(p) for p in CPU_SOURCES]
    kwargs = {}
    if with_cuda:
        sources += [str(p) for p in CUDA_SOURCES]
        kwargs["extra_cuda_cflags"] = ["-O3", "--use_fast_math", "-std=c++17"]
    cpp_extension.load(name=name, sources=sources, extra_cflags=_cpu_flags(), build_directory=str(out),
                       is_python_module=False, verbose=verbose, **kwargs)
    return _library_path(cache_dir(), name)


def load(verbose: bool = False, force: bool = False) -> bool:
    """Build (if needed) and load the extension; True when `torch.ops.megatron_fused` is usable."""
    if _state["loaded"] is not None and not force:
        return _state["loaded"]
    _state["loaded"] = _load(verbose)
    return _state["loaded"]


def _load(verbose: bool) -> bool:
    import torch
    if os.environ.get("MEGATRON_NO_FUSED_KERNELS", "0") not in ("", "0"):
        _state["reason"] = "MEGATRON_NO_FUSED_KERNELS is set"
        return False
    if hasattr(torch.ops, "megatron_fused") and hasattr(torch.ops.megatron_fused, "bias_gelu_forward"):
        return True  # already registered in this process
    try:
        with_cuda = _with_cuda()
        name = build_key(with_cuda)
    except Exception as e:  # unreadable sources, broken torch install
        _warn(f"{type(e).__name__}: {e}")
        return False
    root = cache_dir()
    so, ok = _library_path(root, name), root / f"{name}.ok"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        if not (so.exists() and ok.exists()):
            if local_rank == 0:
                missing = _compiler_missing()
                if missing:
                    _warn(missing)
                    return False
                so = _build_once(root, name, with_cuda, verbose)
            else:
                so = _wait_for_rank0(root, name)
        torch.ops.load_library(str(so))
        _state["cuda"] = with_cuda
        return True
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _warn(f"build or load failed: {type(e).__name__}: {first[:200]} -- "
              "`python -m megatron.fused_kernels -v` shows the compiler output")
        return False


def _wait_bound() -> float:
    return float(os.environ.get("MEGATRON_FUSED_KERNELS_WAIT", "900"))


def _build_once(root: Path, name: str, with_cuda: bool, verbose: bool) -> Path:
    """Build under this extension's lock (build_lock.py), or use the build another process
    finished while we waited for its lock."""
    so, ok, failed = _library_path(root, name), root / f"{name}.ok", root / f"{name}.failed"
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{name}.building"
    if not build_lock.acquire(lock, lambda: so.exists() and ok.exists(), _wait_bound()):
        return so
    try:
        if so.exists() and ok.exists():  # finished by another process between its release and our take
            return so
        return _build_locked(name, with_cuda, verbose, root, ok, failed)
    finally:
        build_lock.release(lock)


def _build_locked(name: str, with_cuda: bool, verbose: bool, root: Path, ok: Path, failed: Path) -> Path:
    """The build proper, run while holding this extension's build lock."""
    failed.unlink(missing_ok=True)
    build_lock.clear_torch_lock(root / name)  # only a dead build can have left torch's lock now
    # the first iteration would otherwise be silent for the whole compile
    print(f"building fused kernels (one-time, ~30 s on 2 idle cores) in {root / name} ...", file=sys.stderr, flush=True)
    try:
        so = _build(name, with_cuda, verbose)
    except BaseException as e:
        failed.write_text(f"{type(e).__name__}: {e}\n")
        raise
    ok.write_text(str(so) + "\n")
    return so


def _wait_for_rank0(root: Path, name: str) -> Path:
    """Non-zero local ranks wait for the local rank 0's build of the same sources."""
    so, ok, failed = _library_path(root, name), root / f"{name}.ok", root / f"{name}.failed"
    limit = _wait_bound()
    start = last_report = time.time()
    while time.time() - start < limit:
        if ok.exists() and so.exists():
            return so
        if time.time() - last_report >= 30:
            last_report = time.time()
            print(f"fused kernels: waiting {last_report - start:.0f}s for local rank 0's build of {name} "
                  f"(limit {limit:.0f}s)", file=sys.stderr, flush=True)
        # a failure stamp from this launch (not an old one that rank 0 is about to remove)
        if failed.exists() and failed.stat().st_mtime >= start - 5:
            raise RuntimeError(f"local rank 0 failed to build {name}: {failed.read_text().strip()}")
        time.sleep(0.5)
    raise TimeoutError(f"waited {limit:.0f}s for local rank 0 to build {name} in {root} "
                       "(raise MEGATRON_FUSED_KERNELS_WAIT or pre-build with `python -m megatron.fused_kernels`)")


def available() -> bool:
    """True when the fused ops are registered (loads them on first call)."""
    return load()


def has_cuda_kernels() -> bool:
    """True when the loaded extension was built with its CUDA kernels."""
    return load() and bool(_state.get("cuda"))


def unavailable_reason() -> Optional[str]:
    return _state["reason"]
