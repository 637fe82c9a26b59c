"""Smoke test of benchmarks/bench_planner.py on the shipped A100 table: one JSON row per setting
with a speed-up field per baseline, and DynaPipe (with its search over packed rows) never slower
than the best baseline on the same batches (the guarantee the search is built for)."""
import argparse
import json

from benchmarks.bench_planner import ROOT, run
from megatron.planner.dynapipe.baselines import NAMES


def test_row_has_every_baseline_and_dynapipe_is_never_slower(capsys):
    args = argparse.Namespace(tokens=16384, iters=1, warmup=1, baseline_iters=1, lower_iters=1,
                              cost_models=str(ROOT / "cost_models"), no_packed_rows=False, zero_bubble=False, moe=False)
    row = run("gpt", 2048, args, "bimodal")
    json.dumps(row)  # JSON-serialisable
    for name in NAMES:
        assert f"speedup_vs_{name}" in row
    finite = [row[f"speedup_vs_{n}"] for n in NAMES if row[f"speedup_vs_{n}"] is not None]
    assert finite and row["speedup_vs_best_baseline"] == min(finite)
    assert row["speedup_vs_best_baseline"] >= 1.0
