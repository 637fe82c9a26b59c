"""Zero-bubble schedules priced: the greedy I/F/W scheduler, the simulator's split backward,
the derived W share, DynaPipe's "zb" candidate and its never-slower fallback."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.schedule.schedules import one_f_one_b, search
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, check_dependencies, simulate
from megatron.planner.schedule.zb_search import derive_wgrad, gemm_share, zb_candidate
from megatron.planner.schedule.zero_bubble import greedy_zb_orders, kept_limits, stage_to_rank_of, zb_orders

ROOT = Path(__file__).resolve().parents[3]


def _unit(S, m, scale=1.0):
    z = np.zeros((S, m))
    return PipelineCosts(z + scale, z + 2 * scale, z + scale, z, z, wgrad=z + scale)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_zero_bubble_schedules_close_the_bubble_in_simulation(p, m):
    base = simulate(_unit(p, m), one_f_one_b(p, list(range(m)))).makespan
    assert base == 3 * m + 3 * (p - 1)  # 1F1B: (p - 1)(F + B + W) of bubble
    got = {}
    for sch in ("zb-h1", "zb-h2", "zb-v", "dualpipev"):
        orders, s2r = zb_orders(sch, m, p)
        assert s2r == stage_to_rank_of(sch, p)
        scale = 0.5 if len(s2r) == 2 * p else 1.0  # a V chunk is half a stage
        costs = _unit(len(s2r), m, scale)
        res = simulate(costs, orders, s2r)
        check_dependencies(res, costs, s2r)
        assert max(res.peak_memory) <= max(kept_limits(sch, p, m)) * scale + 1e-9
        got[sch] = res.makespan
    # only the fill before the last rank's first forward is left (a V's forwards take half)
    assert got["zb-h1"] == got["zb-h2"] == 3 * m + (p - 1)
    assert got["zb-v"] == got["dualpipev"] == 3 * m + (p - 1) / 2


def test_input_first_greedy_keeps_its_limits_under_a_cost_table():
    # DynaPipe's searches run the greedy's default policy on their own costs: limits still hold
    p, m = 4, 8
    cost = lambda k, mb, s: {"F": 1.0, "I": 1.5, "W": 0.5, "B": 2.0}[k]  # noqa: E731
    for sch in ("zb-h1", "zb-h2", "zb-v"):
        s2r = stage_to_rank_of(sch, p)
        orders = greedy_zb_orders(m, s2r, kept_limits(sch, p, m), op_cls=ComputeOp, cost=cost)
        res = simulate(_unit(len(s2r), m), orders, s2r)
        assert max(res.peak_memory) <= max(kept_limits(sch, p, m))


def test_simulator_refuses_a_weight_pass_without_its_input_pass_on_the_rank():
    costs = _unit(1, 1)
    with pytest.raises(SimulationError, match="no I"):
        simulate(costs, [[ComputeOp("F", 0, 0), ComputeOp("W", 0, 0)]])


def test_deferred_weight_state_is_kept_in_memory_until_w():
    z = np.zeros((1, 2))
    costs = PipelineCosts(z + 1, z + 2, z + 10, z, z, wgrad=z + 1, wstored=z + 4)
    res = simulate(costs, [[ComputeOp("F", 0, 0), ComputeOp("I", 0, 0), ComputeOp("F", 1, 0), ComputeOp("I", 1, 0), ComputeOp("W", 0, 0), ComputeOp("W", 1, 0)]])
    assert res.peak_memory[0] == 14  # F1's 10 MB next to F0's deferred 4 MB
    assert res.memory_trace[0][-1][1] == 0


def test_w_share_is_the_forward_gemm_share():
    assert gemm_share(4096, 4096 * 6) == pytest.approx(0.5)
    w = derive_wgrad(np.array([[10.0]]), np.array([[12.0]]), 4096, np.array([[512.0]]))
    assert w[0, 0] == pytest.approx(6.0)  # capped at half the backward
    assert derive_wgrad(np.array([[10.0]]), np.array([[30.0]]), 1024, 6144)[0, 0] == pytest.approx(5.0)


def test_zb_candidate_stays_under_the_memory_limit_and_refuses_what_cannot_fit():
    rng = np.random.default_rng(0)
    S, m = 4, 10
    f = rng.uniform(1, 3, (1, m)).repeat(S, 0)
    costs = PipelineCosts(f, 2 * f, 10 * f, f, np.full((S, m), 0.1), wgrad=0.9 * f)
    limit = [70.0] * S
    got = zb_candidate(costs, list(range(m)), limit)
    assert got is not None
    res = simulate(costs, got[1])
    assert max(res.peak_memory) <= 70.0 + 1e-9 and res.makespan == pytest.approx(got[0])
    assert zb_candidate(costs, list(range(m)), [5.0] * S) is None
    # searched with the whole-backward schedules, the split one wins here
    ch = search(costs, limit, schedules=("1f1b", "adaptive", "zb"))
    whole = search(costs, limit, schedules=("1f1b", "adaptive"))
    assert ch.name == "zb" and ch.result.makespan < whole.result.makespan


@pytest.mark.parametrize("kind", ["gpt", "t5"])
def test_dynapipe_with_split_backward_is_never_slower_on_the_a100_tables(kind):
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_planner as bp
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    cfg = bp.config(kind, ROOT / "cost_models")
    cfg.emit_plans = False
    zcfg = dataclasses.replace(cfg, schedules=cfg.schedules + ("zb",))
    plain, split = DynaPipePlanner(cfg), DynaPipePlanner(zcfg)
    chose = 0
    for b in bp.make_batches(kind, 1024, 32768, 2, seed=5):
        a, z = plain.plan(b), split.plan(b)
        assert z.makespan_ms <= a.makespan_ms * (1 + 1e-9)
        chose += any(g.schedule == "zb" for g in z.groups)
    assert chose
