"""The searches' fast replay (`megatron.planner.schedule.replay`) against the full simulator, for every
stage-to-rank mapping kind: identity, round-robin (interleaved), and neighbouring stages on one
rank (no transfer between them)."""
import numpy as np
import pytest

from megatron.planner.dynapipe.interleaved import interleaved_orders
from megatron.planner.schedule.replay import MEM_SLACK_MB, cost_lists, replay
from megatron.planner.schedule.schedules import one_f_one_b
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, simulate


def _costs(rng, S, K, epilogue):
    a = [rng.uniform(0.5, 2.0, (S, K)) for _ in range(5)]
    return PipelineCosts(*a, grad_comm=a[4] / 3, grad_comm_epilogue_only=epilogue)


def _block_orders(S, K, v):
    """Stages [r v, (r+1) v) on rank r; every forward in stage order, then every backward."""
    ranks = S // v
    return [[ComputeOp("F", mb, s) for mb in range(K) for s in range(r * v, (r + 1) * v)]
            + [ComputeOp("B", mb, s) for mb in range(K) for s in reversed(range(r * v, (r + 1) * v))]
            for r in range(ranks)]


@pytest.mark.parametrize("epilogue", [False, True])
def test_replay_equals_simulate_for_every_mapping(epilogue):
    rng = np.random.default_rng(3)
    for _ in range(4):
        S, K = 4, 5
        c = _costs(rng, S, K, epilogue)
        order = [int(x) for x in rng.permutation(K)]
        cases = [(None, one_f_one_b(S, order)), (list(range(S)), one_f_one_b(S, order)),
                 ([s % 2 for s in range(S)], interleaved_orders(2, 2, order)),
                 ([s // 2 for s in range(S)], _block_orders(S, K, 2))]
        for s2r, ops in cases:
            ref = simulate(c, ops, s2r)
            got = replay(cost_lists(c), ops, s2r)
            assert got[0] == pytest.approx(ref.makespan, rel=1e-12)
            assert got[1] == pytest.approx(ref.peak_memory, rel=1e-12)
            assert replay(cost_lists(c), ops, s2r, cut=ref.makespan) is None


def test_memory_limit_slack_and_deadlock():
    rng = np.random.default_rng(4)
    c = _costs(rng, 3, 4, False)
    ops = one_f_one_b(3, [0, 1, 2, 3])
    peak = simulate(c, ops).peak_memory
    # a peak within the slack of the limit fits (float sums in another order), past it it does not
    assert replay(cost_lists(c), ops, mem_limit=[p - MEM_SLACK_MB / 2 for p in peak]) is not None
    assert replay(cost_lists(c), ops, mem_limit=[p - 2 * MEM_SLACK_MB for p in peak]) is None
    bad = [list(reversed(o)) for o in ops]  # every stage waits on a backward that never comes
    with pytest.raises(SimulationError, match="deadlocks"):
        replay(cost_lists(c), bad)
