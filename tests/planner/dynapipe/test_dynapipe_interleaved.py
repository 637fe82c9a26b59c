"""DynaPipe over virtual pipeline stages (megatron/planner/dynapipe/interleaved.py)."""
from pathlib import Path

import numpy as np
import pytest

from megatron.pipeline.validator import validate_plans
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from megatron.planner.dynapipe.interleaved import InterleavedDynaPipePlanner, interleaved_orders, microbatch_groups
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, simulate
from megatron.planner.schedule.static import analytic_bubble, interleaved_orders as static_interleaved

CM = Path(__file__).resolve().parents[3] / "cost_models"


def gpt_config(**kw):
    base = dict(cost_model_path=str(CM / "gpt_6.7b_a100.json"), hidden_size=4096, num_layers=32,
                pipeline_parallel=4, data_parallel=2, memory_limit_mb=36000, virtual_stages=2)
    base.update(kw)
    return DynaPipeConfig(**base)


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (3, 3), (4, 4), (8, 2)])
def test_orders_match_megatron_and_never_deadlock(pp, v):
    S = pp * v
    for m in range(1, 4 * pp + 2):
        order = list(range(m))
        ops = interleaved_orders(pp, v, order)
        if m % pp == 0:  # Megatron's schedule exactly
            ref = static_interleaved(m, pp, v)
            assert [[tuple(o) for o in r] for r in ops] == [[(o.kind, o.microbatch, o.stage) for o in r] for r in ref]
        ones = np.ones((S, m))
        simulate(PipelineCosts(ones, 2 * ones, ones, ones, 0.1 * ones), ops, [s % pp for s in range(S)])
        assert sum(len(g) for g in microbatch_groups(pp, order)) == m


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (2, 2, 4), (4, 4, 8), (8, 2, 16)])
def test_uniform_microbatches_reach_megatrons_bubble(pp, v, m):
    """Equal micro-batches, no transfer time: the simulator on the generalised orders gives
    (m + (PP - 1) / v) (t_f + t_b), the interleaved schedule's analytic time."""
    S, ones = pp * v, np.ones((pp * v, m))
    res = simulate(PipelineCosts(ones / v, 2 * ones / v, ones, 0 * ones, 0 * ones),
                   interleaved_orders(pp, v, list(range(m))), [s % pp for s in range(S)])
    assert res.makespan == pytest.approx(analytic_bubble("interleaved", pp, m, 1.0, 2.0, v))
    assert res.makespan < analytic_bubble("1f1b", pp, m, 1.0, 2.0)


def test_short_last_group_of_its_own_would_deadlock():
    """Why a remainder joins the last group: PP 4, v 3, m 5 with a group of one at the end
    deadlocks under Megatron's warm-up count."""
    pp, v, order = 4, 3, list(range(5))
    groups = [order[:4], order[4:]]
    ops = []
    for r in range(pp):
        fwd = [("F", mb, c * pp + r) for g in groups for c in range(v) for mb in g]
        bwd = [("B", mb, c * pp + r) for g in groups for c in reversed(range(v)) for mb in g]
        w = min(2 * (pp - r - 1) + (v - 1) * pp, len(fwd))
        ops.append(fwd[:w] + [x for k in range(len(fwd) - w) for x in (fwd[w + k], bwd[k])] + bwd[len(fwd) - w:])
    ones = np.ones((pp * v, 5))
    with pytest.raises(SimulationError):
        simulate(PipelineCosts(ones, ones, ones, ones, ones), ops, [s % pp for s in range(pp * v)])


def test_planner_on_virtual_stages():
    cfg = gpt_config()
    planner = DynaPipePlanner(cfg)
    assert isinstance(planner, InterleavedDynaPipePlanner) and planner.S == 8 and len(planner.available) == 4
    rng = np.random.default_rng(0)
    lens = np.minimum(2048, rng.lognormal(np.log(200), 1.0, 150).astype(int) + 4).tolist()
    plan = planner.plan(lens)
    seen = sorted(i for g in plan.groups for mb in g.microbatches for i in mb)
    assert seen == list(range(len(lens)))
    for g in plan.groups:
        assert g.schedule == "interleaved" and len(g.plans) == 4
        validate_plans(g.plans)
        assert [p.assigned_stages for p in g.plans] == [(r, r + 4) for r in range(4)]
        # Memory summed over a rank's two chunks stays under what its device has left.
        assert all(p <= a + 1e-6 for p, a in zip(g.peak_memory_mb, planner.available))
        res = g.result
        for r, order in enumerate(res.orders):  # one device per rank: its ops never overlap
            spans = sorted((res.start[op], res.end[op]) for op in order)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
            assert {op.stage % 4 for op in order} == {r}
    assert plan.makespan_ms == max(g.makespan_ms for g in plan.groups)


def test_model_states_summed_per_rank():
    """Each rank holds two chunks of 4 layers: the same model states as one 8-layer stage."""
    inter, flat = DynaPipePlanner(gpt_config()), DynaPipePlanner(gpt_config(virtual_stages=1))
    # rank 0 holds the embedding (stage 0), rank 3 the tied head (stage 7): as without chunks.
    assert np.allclose(inter.available, flat.available)


def test_refuses_what_it_cannot_plan():
    with pytest.raises(ValueError, match="GPT only"):
        DynaPipePlanner(DynaPipeConfig(cost_model_path=str(CM / "t5_11b_a100.json"), model_kind="t5",
                                       hidden_size=1024, encoder_layers=24, decoder_layers=24, virtual_stages=2))
    with pytest.raises(ValueError, match="split evenly"):
        DynaPipePlanner(gpt_config(num_layers=36, virtual_stages=4))


@pytest.mark.parametrize("epilogue", [False, True])
def test_replay_equals_simulate(epilogue):
    """The search's list replay gives the simulator's makespan and per-rank peaks."""
    from megatron.planner.schedule.replay import cost_lists, replay
    rng = np.random.default_rng(1)
    for pp, v, m in [(2, 2, 5), (4, 2, 9), (3, 3, 7), (4, 4, 12)]:
        S = pp * v
        a = [rng.uniform(0.5, 2.0, (S, m)) for _ in range(5)]
        costs = PipelineCosts(*a, grad_comm=a[4] / 3, grad_comm_epilogue_only=epilogue)
        order = list(rng.permutation(m))
        ops = interleaved_orders(pp, v, order)
        ref = simulate(costs, ops, [s % pp for s in range(S)])
        lists = cost_lists(costs)
        got = replay(lists, ops, [s % pp for s in range(S)])
        assert got[0] == pytest.approx(ref.makespan) and got[1] == pytest.approx(ref.peak_memory)
        assert replay(lists, ops, [s % pp for s in range(S)], cut=ref.makespan) is None
        assert replay(lists, ops, [s % pp for s in range(S)], mem_limit=[p - 1e-3 for p in ref.peak_memory]) is None
