import json

import numpy as np
import pytest

from megatron.planner.schedule.schedules import adaptive, one_f_one_b
from megatron.planner.schedule.simulator import (
    ComputeOp, PipelineCosts, SimulationError, check_dependencies, simulate,
)


def uniform(S, K, f, b, stored=10.0, transient=2.0, comm=0.0):
    z = np.ones((S, K))
    return PipelineCosts(z * f, z * b, z * stored, z * transient, z * comm)


def random_costs(rng, S, K):
    return PipelineCosts(rng.uniform(1, 5, (S, K)), rng.uniform(2, 9, (S, K)), rng.uniform(5, 20, (S, K)),
                         rng.uniform(0, 6, (S, K)), rng.uniform(0, 0.5, (S, K)))


@pytest.mark.parametrize("S,K,f,b", [(4, 8, 1.0, 2.0), (2, 5, 1.5, 1.5), (3, 3, 2.0, 3.0), (1, 4, 1.0, 1.0), (4, 2, 1.0, 2.0)])
def test_uniform_1f1b_matches_analytic(S, K, f, b):
    res = simulate(uniform(S, K, f, b), one_f_one_b(S, list(range(K))))
    # Fill + drain: (S-1) * (f + b) of bubble plus K * (f + b) of work on every stage.
    assert res.makespan == pytest.approx((S - 1) * (f + b) + K * (f + b))
    # 1F1B keeps at most S - s micro-batches on stage s.
    for s in range(S):
        assert res.peak_memory[s] == pytest.approx(min(S - s, K) * 10.0 + 2.0)


@pytest.mark.parametrize("seed", range(6))
def test_dependencies_and_memory_accounting(seed):
    rng = np.random.default_rng(seed)
    S, K = 4, int(rng.integers(1, 12))
    costs = random_costs(rng, S, K)
    res = simulate(costs, one_f_one_b(S, list(rng.permutation(K))))
    check_dependencies(res, costs)
    for r in range(S):
        # Ops on a rank never overlap; memory returns to zero after the last backward.
        spans = sorted((res.start[o], res.end[o]) for o in res.orders[r])
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
        assert res.memory_trace[r][-1][1] == pytest.approx(0.0, abs=1e-9)
        assert res.peak_memory[r] == pytest.approx(max(m for _, m in res.memory_trace[r]))
    # Transfers on a link never overlap and start after the producer ends.
    by_link = {}
    for kind, mb, stage, src, dst, t0, t1 in res.comm:
        by_link.setdefault((src, dst), []).append((t0, t1))
        assert t0 >= res.end[ComputeOp("F" if kind == "act" else "B", mb, stage)] - 1e-9
    for spans in by_link.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_deadlock_is_reported():
    S, K = 2, 2
    orders = [[ComputeOp("F", 0, 0), ComputeOp("B", 0, 0), ComputeOp("F", 1, 0), ComputeOp("B", 1, 0)],
              [ComputeOp("F", 1, 1), ComputeOp("B", 1, 1), ComputeOp("F", 0, 1), ComputeOp("B", 0, 1)]]  # stage 1 wants mb 1 first
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(uniform(S, K, 1, 1), orders)


def test_chrome_trace(tmp_path):
    costs = uniform(2, 3, 1.0, 2.0, comm=0.25)
    res = simulate(costs, one_f_one_b(2, [0, 1, 2]))
    path = tmp_path / "trace.json"
    res.save_chrome_trace(path)
    ev = json.loads(path.read_text())["traceEvents"]
    compute = [e for e in ev if e.get("cat") == "compute"]
    assert len(compute) == 12 and {e["pid"] for e in compute} == {0, 1}
    assert len([e for e in ev if e.get("cat") == "comm"]) == 6  # 3 activations + 3 gradients
    assert max(e["ts"] + e["dur"] for e in compute) == pytest.approx(res.makespan * 1e3)


@pytest.mark.parametrize("seed", range(8))
def test_adaptive_respects_memory_and_replays_identically(seed):
    rng = np.random.default_rng(100 + seed)
    S, K = 4, int(rng.integers(2, 15))
    costs = random_costs(rng, S, K)
    limit = [float(rng.uniform(1.0, 3.5) * (costs.stored[s] + costs.transient[s]).max()) for s in range(S)]
    orders = adaptive(costs, list(range(K)), limit)
    res = simulate(costs, orders)
    check_dependencies(res, costs)
    assert all(p <= m + 1e-9 for p, m in zip(res.peak_memory, limit))
    # Every stage runs forwards in the given order and backwards in its successor's order.
    for s in range(S):
        assert [o.microbatch for o in orders[s] if o.kind == "F"] == list(range(K))
        if s < S - 1:
            assert [o.microbatch for o in orders[s] if o.kind == "B"] == \
                   [o.microbatch for o in orders[s + 1] if o.kind == "B"]
