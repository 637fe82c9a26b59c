"""The CPU trainer keeps freed host memory in its heap (glibc mallopt), unless told not to."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = "from megatron.core.host_memory import keep_freed_host_memory as k; print(k(), k())"


def _run(**env):
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_applied_once_on_glibc():
    assert _run() == ["True", "True"]


def test_opt_out():
    assert _run(MEGATRON_NO_HOST_MALLOC_TUNING="1") == ["False", "False"]
