"""Smoke test of benchmarks/bench_terapipe.py's simulation path on the shipped A100 table: the
JSON row is complete and self-consistent (the planned slices cover the sequence, the reported
TeraPipe time is the pipeline formula over its units). Speed-ups are printed, not asserted."""
import numpy as np
import pytest

from benchmarks.bench_terapipe import ROOT, simulate
from megatron.planner.cost.cost_model import CostModel
from megatron.planner.terapipe.lowering import pipeline_score
from megatron.planner.terapipe.latency import from_cost_model


def test_simulated_row_is_consistent():
    np.seterr(invalid="ignore")
    lat = from_cost_model(CostModel.load(ROOT / "cost_models" / "gpt_6.7b_a100.json"))
    row = simulate(8, 2048, 2, lat)
    assert sum(row["slices"]) == 2048 and all(s % 8 == 0 for s in row["slices"])
    b, m = row["terapipe_mbs"], 2 // row["terapipe_mbs"]
    offs = np.cumsum([0] + row["slices"][:-1])
    units = [lat.stage_ms(b, l, c, row["layers_per_stage"]) for _ in range(m) for l, c in zip(row["slices"], offs)]
    assert row["terapipe_ms"] == pytest.approx(pipeline_score(units, 8), rel=1e-3)
    assert row["baseline_ms"] == pytest.approx((2 + 7) * lat.stage_ms(1, 2048, 0, 4), rel=1e-3)
    assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["terapipe_ms"], rel=1e-2)
