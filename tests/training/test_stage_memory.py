"""Memory per pipeline stage (training/stage_memory.py) on 2 gloo ranks, one stage each: every
rank gets every stage's peak, and each stage's number is what the kernel reports for that
process (between its VmHWM in /proc/self/status, the kernel's peak resident set, just before
and just after)."""
import sys

import pytest
import torch

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _status_mib(key: str = "VmHWM") -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    return kb / 1024


def _vmhwm_mib() -> float:
    return _status_mib("VmHWM")


def _rank(rank, world):
    from megatron.training.stage_memory import stage_peaks_mb
    start = _vmhwm_mib()
    if rank == 1:
        # Raise stage 1's high-water mark 64 MiB above whatever it was: a worker process may carry
        # an earlier test's peak, so the two ranks' starting marks need not be equal.
        big = torch.ones(int((start - _status_mib("VmRSS") + 64) * 2 ** 20) // 4)
        big += 1
    cpu = torch.device("cpu")
    before = _vmhwm_mib()
    what, peaks = stage_peaks_mb(rank, world, world, cpu, cpu)
    return what, peaks, (before, _vmhwm_mib()), start


def test_every_rank_gets_every_stage_peak_as_the_kernel_reports_it():
    rows = run_distributed(_rank, 2)
    (w0, p0, hwm0, _), (w1, p1, hwm1, _) = rows
    assert w0 == w1 == "peak_rss_mb" and p0 == p1
    # the peak read inside lies between the kernel's high-water marks just before and just after
    for peak, (before, after) in zip(p0, (hwm0, hwm1)):
        assert before - 1.0 <= peak <= after + 1.0, (peak, before, after)
    # Stage 1 raised its mark (the kernel's RSS counters are batched, so by less than it touched:
    # 24 of 64 MiB seen once); where the two ranks' marks are apart, the stage numbers are too
    if hwm1[0] > hwm0[1] + 2.0:
        assert p0[1] > p0[0], (p0, hwm0, hwm1)


def test_one_process_needs_no_collective():
    from megatron.training.stage_memory import stage_peaks_mb
    cpu = torch.device("cpu")
    what, peaks = stage_peaks_mb(0, 1, 1, cpu, cpu)
    assert what == "peak_rss_mb" and len(peaks) == 1 and peaks[0] == pytest.approx(_vmhwm_mib(), abs=2.0)
