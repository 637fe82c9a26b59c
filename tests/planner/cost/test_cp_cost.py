"""Context parallelism priced from the cost table (megatron/planner/cost/cp_cost.py)."""
import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.cost.cp_cost import ContextParallelCostModel, cp_planner

A100 = "cost_models/gpt_6.7b_a100.json"


@pytest.fixture(scope="module")
def table():
    return CostModel.load(A100)


def test_a_cp_rank_does_its_share_of_attention_and_exchanges_kv(table):
    s, b = 8192.0, 1.0
    whole = table.layer("encoder", 1, "selective", b, s)
    half = table.layer("encoder", 1, "selective", b, s / 2)
    for comm in ("p2p", "all_gather"):
        cp = ContextParallelCostModel(table, 2, comm).layer("encoder", 1, "selective", b, s)
        # less than the whole sequence, more than a row of s/2 tokens (its queries see all s keys)
        assert half["forward_ms"] < cp["forward_ms"] < whole["forward_ms"]
        assert half["backward_ms"] < cp["backward_ms"] < whole["backward_ms"]
    ag = ContextParallelCostModel(table, 2, "all_gather")
    ring = ContextParallelCostModel(table, 2, "p2p")
    # K and V of the other rank's half, 16-bit: 2 * s/2 * h * 2 bytes
    assert float(ag.exchange_mb(1, b, s)) == pytest.approx(2 * s / 2 * 4096 * 2 / 1e6)
    # the ring overlaps its blocks with attention; neither exchange stores K/V it fetched (both
    # fetch them again in the backward), so both store what s/2 tokens with a flash kernel store
    r, a = ring.layer("encoder", 1, "selective", b, s), ag.layer("encoder", 1, "selective", b, s)
    assert r["forward_ms"] <= a["forward_ms"]
    assert r["stored_mb"] == a["stored_mb"] < 0.6 * whole["stored_mb"]
    ag4, ring4 = ContextParallelCostModel(table, 4, "all_gather"), ContextParallelCostModel(table, 4, "p2p")
    assert ring4.layer("encoder", 1, "none", b, s)["peak_mb"] < ag4.layer("encoder", 1, "none", b, s)["peak_mb"]


def test_cp_prices_sequences_past_the_table(table):
    # the table stops at 8192 tokens; CP 4 runs 32768-token sequences on 8192-token chunks
    assert not np.isfinite(table.layer("encoder", 1, "full", 1, 32768)["forward_ms"])
    assert np.isfinite(ContextParallelCostModel(table, 4).layer("encoder", 1, "full", 1, 32768)["forward_ms"])


def test_dynapipe_plans_with_a_static_cp_size_where_it_alone_cannot():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from bench_planner import make_batches
    from megatron.experiments.slicing import planner_for
    from megatron.planner.dynapipe.planner import PlanningError
    batch = make_batches("gpt", 16384, 65536, 1, seed=17384)[0]
    assert max(batch) > 8192
    alone = planner_for(4, 2)
    with pytest.raises(PlanningError):
        alone.plan(batch, validate=False)
    plan = cp_planner(alone.cfg, 2).plan(batch, validate=False)
    assert np.isfinite(plan.makespan_ms)
    with pytest.raises(ValueError, match="CP 4 does not divide the 2 data-parallel ranks"):
        cp_planner(alone.cfg, 4)
