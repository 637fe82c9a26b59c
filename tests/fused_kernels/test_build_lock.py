"""The fused-kernel build lock (build_lock.py): a killed build's locks are taken over, a live
builder is waited for with progress and a bound. The compile itself is replaced by a stand-in
that writes the library file, so each test takes well under a second."""
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron import fused_kernels
from megatron.fused_kernels import build_lock

NAME = "megatron_fused_cpu_test"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def fake_build(monkeypatch):
    """Replaces the compile: records each call and what it found, writes the .so."""
    calls = []

    def build(name, with_cuda, verbose):
        so = fused_kernels._library_path(fused_kernels.cache_dir(), name)
        calls.append({"torch_lock_left": (so.parent / "lock").exists()})
        so.write_bytes(b"not a real library")
        return so

    monkeypatch.setattr(fused_kernels, "_build", build)
    return calls


def test_lock_of_a_killed_build_is_taken_over(tmp_path, monkeypatch, fake_build, capfd):
    """What kill -9 during `cpp_extension.load` leaves: our owner record naming a dead pid and
    torch's empty `lock` in the build folder (torch alone would wait for it forever)."""
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_WAIT", "5")
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "lock").write_text("")
    pid = _dead_pid()
    (tmp_path / f"{NAME}.building").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    t0 = time.time()
    so = fused_kernels._build_once(tmp_path, NAME, False, False)
    assert time.time() - t0 < 3
    assert so.exists() and (tmp_path / f"{NAME}.ok").exists()
    assert fake_build == [{"torch_lock_left": False}]
    assert not (tmp_path / f"{NAME}.building").exists()  # released after the build
    err = capfd.readouterr().err
    assert f"process {pid} on {socket.gethostname()} is not running" in err
    assert "left by an interrupted build" in err


def test_torch_lock_alone_is_removed(tmp_path, monkeypatch, fake_build, capfd):
    """A torch `lock` without our record (an interrupted build by an older version)."""
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_DIR", str(tmp_path))
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "lock").write_text("")
    fused_kernels._build_once(tmp_path, NAME, False, False)
    assert fake_build == [{"torch_lock_left": False}]
    assert "left by an interrupted build" in capfd.readouterr().err


def test_old_lock_from_another_host_is_taken_over_by_age(tmp_path):
    lock = tmp_path / "x.building"
    lock.write_text(json.dumps({"pid": 1, "host": "some-other-host"}))
    past = time.time() - 100
    import os
    os.utime(lock, (past, past))
    assert build_lock.acquire(lock, lambda: False, bound_s=50, poll_s=0.01)
    assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_live_builder_is_waited_for_with_progress_then_bounded(tmp_path, capfd):
    """Our own (live) pid holds the lock: waited for, progress printed, TimeoutError at the bound."""
    lock = tmp_path / "x.building"
    lock.write_text(json.dumps({"pid": subprocess.os.getpid(), "host": socket.gethostname()}))
    t0 = time.time()
    with pytest.raises(TimeoutError, match=r"x\.building.*delete that file.*MEGATRON_FUSED_KERNELS_WAIT"):
        build_lock.acquire(lock, lambda: False, bound_s=0.6, progress_s=0.2, poll_s=0.05)
    assert 0.6 <= time.time() - t0 < 3
    assert "waiting" in capfd.readouterr().err
    assert lock.exists()  # a live builder's lock is never removed


def test_waiter_uses_the_live_builders_result(tmp_path, monkeypatch, fake_build):
    """A second launch waits for the first; when the first's stamp appears it loads that build."""
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS_DIR", str(tmp_path))
    lock = tmp_path / f"{NAME}.building"
    lock.write_text(json.dumps({"pid": subprocess.os.getpid(), "host": socket.gethostname()}))
    so = fused_kernels._library_path(tmp_path, NAME)

    def finish():
        time.sleep(0.3)
        so.parent.mkdir(parents=True)
        so.write_bytes(b"x")
        (tmp_path / f"{NAME}.ok").write_text(str(so))
        lock.unlink()

    th = threading.Thread(target=finish)
    th.start()
    try:
        assert fused_kernels._build_once(tmp_path, NAME, False, False) == so
    finally:
        th.join()
    assert fake_build == []  # nothing compiled a second time
