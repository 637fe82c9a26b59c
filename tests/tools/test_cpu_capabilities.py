"""`make test-variants` runs the parity tests under every ATEN_CPU_CAPABILITY the CPU can run,
and never under one it cannot (PyTorch does not check: a forced avx512 on an AVX2 CPU dies of
SIGILL instead of testing anything)."""
import os
import platform
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "cpu_capabilities.sh")
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")

AVX2_ONLY = "sse4_2 avx f16c fma avx2 bmi2"  # e.g. an Intel Haswell, an AMD Zen 2
AVX512 = AVX2_ONLY + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"  # e.g. an AMD EPYC Genoa


def _caps(tmp_path, flags: str, *opts) -> list:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu {flags} lm\n\n"
                    f"processor\t: 1\nflags\t\t: fpu {flags} lm\n")
    return subprocess.run(["sh", SCRIPT, *opts, str(info)], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("flags,want", [("sse4_2 avx", ["default"]),
                                        ("avx avx2", ["default"]),  # PyTorch's AVX2 also needs FMA
                                        (AVX2_ONLY, ["default", "avx2"]),
                                        (AVX512, ["default", "avx2", "avx512"]),
                                        (AVX2_ONLY + " avx512f", ["default", "avx2"])])  # no bw/vl/dq
def test_capabilities_follow_the_cpu_flags(tmp_path, flags, want):
    assert _caps(tmp_path, flags) == want


@pytest.mark.parametrize("flags,want", [("sse4_2 avx", []), (AVX2_ONLY, ["default"]), (AVX512, ["default", "avx2"])])
def test_skip_native_leaves_out_what_make_test_ran(tmp_path, flags, want):
    assert _caps(tmp_path, flags, "--skip-native") == want


def test_this_machine_lists_its_native_capability():
    import torch
    native = torch.backends.cpu.get_cpu_capability().lower()  # e.g. "AVX2"
    got = subprocess.run(["sh", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    assert got[0] == "default"
    if native in ("avx2", "avx512") and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert got[-1] == native, (native, got)  # PyTorch picks the highest: --skip-native drops it
