"""DynaPipe's stage memory model against the project's real stages (bench_memory_model's rows),
and the shipped CPU tables against a fresh profile of the current code (issue 30)."""
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.profiling.memory_rows import dynapipe_rows, model_config
from megatron.profiling.profiler import ProfileSpec, run_profile

CM = Path(__file__).resolve().parents[2] / "cost_models"
SETTINGS = ("none", "selective", "full")


def _check(rows, tol=0.05):
    assert rows
    for r in rows:
        where = f"{r['model']} {r['setting']} {r['role']} {r['mbs']}x{r['seq']}"
        assert abs(r["error"]) < tol, f"{where}: stored {r['predicted_bytes']} predicted vs {r['measured_bytes']}"
        assert abs(r["peak_error"]) < tol, f"{where}: peak {r['predicted_peak_bytes']} vs {r['measured_peak_bytes']}"


def test_gpt_stages_within_5_percent_on_and_off_the_grid():
    """First (embedding), middle, last (head + loss) and whole-model stages; seq 48 lies between
    the table's 32 and 64, where the s^2 term made linear interpolation 5-10 % high."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    _check(list(dynapipe_rows(cm, SETTINGS, shapes=[(2, 48)])))  # (2, 64) is checked on the grid below


def test_gpt_memory_past_the_grid_where_the_fit_is_trusted():
    """768 tokens on a 16..512 grid: stored memory extrapolated by the held-out-checked fit."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    rows = list(dynapipe_rows(cm, ("selective",), shapes=[(1, 768)], roles=["middle"]))
    assert abs(rows[0]["error"]) < 0.02 and abs(rows[0]["peak_error"]) < 0.02


def test_a_stage_with_the_embedding_runs_past_the_tables_positions():
    """bench_memory_model.py's default shapes end at (1, 768), past the table's 512 positions:
    the first stage (position embedding) is built long enough instead of an IndexError."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    row, = dynapipe_rows(cm, ("full",), shapes=[(1, 768)], roles=["first"])
    assert row["seq"] == 768 and row["measured_bytes"] > 0 and abs(row["error"]) < 0.05


def test_t5_stages_within_5_percent():
    cm = CostModel.load(CM / "cpu_tiny_t5.json")
    _check(list(dynapipe_rows(cm, SETTINGS, shapes=[(2, 48, 24)])))


@pytest.mark.parametrize("name,shape", [("cpu_tiny_gpt", (2, 64)), ("cpu_tiny_t5", (2, 32, 16))])
def test_shipped_table_matches_a_fresh_profile_of_this_code(name, shape):
    """Memory is deterministic: a table profiled by older code (or another model) shows here.
    Times are not compared (a shared CPU makes them noisy)."""
    cm = CostModel.load(CM / f"{name}.json")
    t5 = cm.kind == "t5"
    spec = ProfileSpec(model=model_config(cm, 2), tps=[1], micro_batch_sizes=[shape[0]], seq_lengths=[shape[1]],
                       decoder_seq_lengths=[shape[2]] if t5 else [], layers=2, warmup=0, iters=1)
    fresh = run_profile(spec)
    comps = ["encoder", "decoder"] if t5 else ["encoder"]
    for rc in SETTINGS:
        for comp in comps:
            a, b = fresh.layer(comp, 1, rc, *shape), cm.layer(comp, 1, rc, *shape)
            for q in ("stored_mb", "peak_mb"):
                assert float(a[q]) == pytest.approx(float(b[q]), rel=0.01, abs=2e-4), f"{name} {rc} {comp} {q}"
        head = shape[2] if t5 else shape[1]
        for comp, s in (("postprocess", head), ("preprocess", shape[1])):
            a = fresh.profile(1, rc).components[comp](shape[0], s)
            b = cm.profile(1, rc).components[comp](shape[0], s)
            for q in ("stored_mb", "peak_mb"):
                assert float(a[q]) == pytest.approx(float(b[q]), rel=0.01, abs=2e-4), f"{name} {rc} {comp} {q}"
    assert np.isfinite(float(cm.layer("encoder", 1, "none", *shape[:2])["forward_ms"]))
