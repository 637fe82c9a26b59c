"""bench_time_model.py end to end at a toy size: it profiles, calibrates, trains three slicings
and prints the rows it documents (slow: eleven 2-rank torchrun jobs)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_time_model_prints_its_rows():
    out = subprocess.run([sys.executable, "benchmarks/bench_time_model.py", "--seq", "64", "--hidden", "32",
                          "--layers", "2", "--iters", "3", "--warmup", "1", "--fixed", "2",
                          # the plumbing is under test, not the host: a busy one must not refuse it
                          "--max-spread", "1e9", "--max-fit-error", "1e9", "--any-host"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    cal = [r for r in rows if r["benchmark"] == "terapipe_calibration"]
    assert len(cal) == 1 and cal[0]["calibration"]["meta"]["runs"] == 8
    assert "1x64x4x8" in cal[0]["calibration"]["meta"]["shapes"]  # sliced runs too
    models = [r for r in rows if r["benchmark"] == "terapipe_time_model"]
    assert [r["slices"] for r in models] == ["1", "2", "auto"]
    assert models[0]["chosen"] == "[64]" and models[1]["chosen"] == "[32, 32]"
    for r in models:
        assert r["simulated_ms"] > 0 and r["measured_ms"] > 0
        # the printed times are rounded to 0.1 ms, the error is not (toy steps take a few ms)
        assert r["error"] == pytest.approx(r["simulated_ms"] / r["measured_ms"] - 1, abs=0.1 / r["measured_ms"] + 2e-3)
    summary = rows[-1]
    assert summary["benchmark"] == "terapipe_auto_vs_unsliced" and summary["measured_speedup"] > 0
