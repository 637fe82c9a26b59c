import numpy as np
import pytest

from megatron.planner.schedules import (
    ScheduleInfeasible, adaptive, candidate_orders, one_f_one_b, search,
)
from megatron.planner.simulator import PipelineCosts, simulate


def costs_from(rng, S, K):
    size = rng.uniform(0.3, 3.0, K)  # heterogeneous micro-batches, same shape on all stages
    row = lambda scale: np.tile(size * scale, (S, 1))  # noqa: E731
    return PipelineCosts(row(1.0), row(2.0), row(10.0), row(4.0), row(0.05))


def test_1f1b_order_shape():
    ops = one_f_one_b(3, [2, 0, 1])
    assert [str(o.kind) + str(o.microbatch) for o in ops[0]] == ["F2", "F0", "F1", "B2", "B0", "B1"]
    assert [o.kind + str(o.microbatch) for o in ops[2]] == ["F2", "B2", "F0", "B0", "F1", "B1"]


@pytest.mark.parametrize("seed", range(5))
def test_search_returns_fastest_fitting_candidate(seed):
    rng = np.random.default_rng(seed)
    S, K = 4, 10
    costs = costs_from(rng, S, K)
    limit = [float(rng.uniform(2.5, 6.0) * (costs.stored[0] + costs.transient[0]).max())] * S
    best = search(costs, limit, max_orders=4)
    assert best is not None
    assert all(p <= m + 1e-6 for p, m in zip(best.result.peak_memory, limit))
    # Exhaustively re-simulate every candidate the search considers.
    for order in candidate_orders(costs, 4):
        r = simulate(costs, one_f_one_b(S, order))
        if all(p <= m + 1e-6 for p, m in zip(r.peak_memory, limit)):
            assert best.result.makespan <= r.makespan + 1e-9
        r = simulate(costs, adaptive(costs, order, limit))
        assert best.result.makespan <= r.makespan + 1e-9


def test_adaptive_runs_when_1f1b_does_not_fit():
    S, K = 4, 6
    z = np.ones((S, K))
    costs = PipelineCosts(z, 2 * z, 10 * z, 1 * z, 0 * z)
    limit = [25.0] * S  # two micro-batches in flight; 1F1B wants four on stage 0
    assert search(costs, limit, schedules=("1f1b",)) is None
    best = search(costs, limit)
    assert best.name == "adaptive" and max(best.result.peak_memory) <= 25.0
    with pytest.raises(ScheduleInfeasible, match="micro-batch 0 needs 11 MB on stage 0"):
        adaptive(costs, list(range(K)), [10.5] * S)


def test_bound_prunes():
    rng = np.random.default_rng(3)
    costs = costs_from(rng, 4, 8)
    best = search(costs, [1e9] * 4)
    assert search(costs, [1e9] * 4, bound=best.result.makespan) is None  # nothing strictly better
    assert search(costs, [1e9] * 4, bound=best.result.makespan * 1.01).result.makespan == best.result.makespan
