"""The composed figure's driver (megatron/experiments/slicing.py): one CSV row per max length
and system, a PNG beside it, everything under --out (nothing tracked is written)."""
import csv
import subprocess
from pathlib import Path

from megatron.experiments import slicing

ROOT = Path(__file__).resolve().parents[2]


def test_driver_writes_csv_and_png_under_out(tmp_path):
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    rc = slicing.main(["--out", str(tmp_path), "--max-lens", "1024", "--batches", "1",
                       "--lengths-file", str(ROOT / "tests/experiments/lengths_fixture.txt")])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "dynapipe_slicing.csv")))
    assert [r["system"] for r in rows] == list(slicing.SYSTEMS)
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    # slicing is a candidate, never a loss: auto keeps the unsliced plan when that is faster
    t = {r["system"]: float(r["mean_iteration_ms"]) for r in rows}
    assert t["dynapipe_slices"] <= t["dynapipe"] + 1e-6
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "dynapipe_slicing.png").is_file()
    except ImportError:
        pass
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout == before
    assert slicing.main(["--out", str(tmp_path), "--max-lens", "x"]) == 2
