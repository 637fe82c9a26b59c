"""TeraPipe's two-level DP: the batch dimension with uneven groups.

`terapipe.plan_batch` cuts a batch of B sequences into B / b equal micro-batches that all use
one slicing. The published TeraPipe planner is more general: the batch splits into groups of
any sizes b_1 + ... + b_g = B, each group with its own token slicing. All units still run back
to back on K stages, so the iteration takes ``sum over every unit of t + (K - 1) * max t``.

For a cap tau on a unit's time, S_b(tau) = the least ``sum t_i`` over slicings of one group of b
sequences with every t_i <= tau (the slice DP of `terapipe`, run for all caps at once), and a
knapsack over group sizes gives G(tau, B) = min over b of G(tau, B - b) + S_b(tau). The plan is
the tau minimising ``G(tau, B) + (K - 1) * tau``. Caps come from the distinct unit times, pruned
above by the uniform plan's score (no cap beyond ``(U - G_min) / (K - 1)`` can win) and thinned
to `cap_tolerance` as in `terapipe.plan_slices`. The uniform plan is in this search space, so
the result is never slower than `plan_batch`'s; it is also returned when it ties.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import numpy as np

from megatron.planner.terapipe.lowering import (GRID, _cost_matrix, _dp_for_caps, _thin, default_cap_tolerance,
                                                pipeline_score, plan_batch, slice_times)


@dataclass
class GroupPlan:
    groups: List[Tuple[int, List[int]]]   # (sequences in the group, token slices), in run order
    score: float                          # sum of every unit's t + (K - 1) * max t
    uniform_score: float                  # the best equal-micro-batch plan (`plan_batch`)
    planning_s: float = 0.0
    caps_tried: int = 0
    times: List[float] = field(default_factory=list)


def _slicing(points, arg_row) -> List[int]:
    cuts, n = [], len(points) - 1
    while n > 0:
        cuts.append(n)
        n = int(arg_row[n])
    cuts.append(0)
    cuts.reverse()
    return [points[b] - points[a] for a, b in zip(cuts, cuts[1:])]


def plan_batch_groups(batch: int, seq_len: int, num_stages: int, t: Callable, grid: int = GRID,
                      mem_ok: Optional[Callable[[int, List[int]], bool]] = None,
                      cap_tolerance: Optional[float] = None, vectorized: bool = False) -> GroupPlan:
    """`t(b, l, c)` is a unit's stage time (b sequences, l tokens after c); `mem_ok(b, slices)`
    rejects a group over the memory limit. Returns the best `GroupPlan`."""
    t0 = time.perf_counter()
    tol = default_cap_tolerance(seq_len) if cap_tolerance is None else cap_tolerance
    ub, uniform = plan_batch(batch, seq_len, num_stages, t, grid, mem_ok, cap_tolerance=tol, vectorized=vectorized)
    best = GroupPlan([(ub, list(uniform.slices))] * (batch // ub), uniform.score, uniform.score)
    points = list(range(0, seq_len, grid)) + [seq_len]
    P = len(points)
    costs = {b: _cost_matrix(points, (lambda l, c, b=b: t(b, l, c)), vectorized) for b in range(1, batch + 1)}
    # G_min: the knapsack over unconstrained group times (a lower bound on any plan's unit sum)
    free = {b: float(_dp_for_caps(costs[b], np.array([np.inf]))[0][0, -1]) for b in costs}
    g_min = _knapsack(np.array([[free[b] for b in range(1, batch + 1)]]), batch)[0][0]
    k = num_stages
    hi = (uniform.score - g_min) / (k - 1) if k > 1 else np.inf
    lo = min(max(float(c[n - 1, n]) for n in range(1, P)) for c in costs.values())
    vals = np.unique(np.concatenate([c[np.isfinite(c)] for c in costs.values()]))
    caps = vals[(vals >= lo) & (vals <= hi * (1 + 1e-12))]
    if tol > 0:
        caps = _thin(caps, tol)
    if not len(caps):
        best.planning_s = time.perf_counter() - t0
        return best
    dps = {b: _dp_for_caps(costs[b], caps) for b in costs}          # f[cap, point], arg[cap, point]
    sums = np.stack([dps[b][0][:, -1] for b in range(1, batch + 1)], axis=1)  # [caps, b-1]
    rejected = set()
    while True:
        g, choice = _knapsack(sums, batch)
        scores = g + (k - 1) * caps
        i = int(np.argmin(scores))
        if not np.isfinite(scores[i]) or scores[i] >= best.score - 1e-12:
            break
        groups, n = [], batch
        while n > 0:
            b = int(choice[i, n])
            groups.append((b, _slicing(points, dps[b][1][i])))
            n -= b
        bad = [b for b, s in groups if mem_ok is not None and not mem_ok(b, s)]
        if bad:  # that group's slicing at this cap overflows: drop it and choose again
            for b in bad:
                sums[i, b - 1] = np.inf
                rejected.add((i, b))
            continue
        times = [x for b, s in groups for x in slice_times(t, b, s)]
        score = pipeline_score(times, k)  # the cap bounds max t; the real max may be lower
        if score < best.score - 1e-12:
            best = GroupPlan(groups, score, uniform.score, times=times)
        break
    best.caps_tried = len(caps)
    best.planning_s = time.perf_counter() - t0
    return best


def _knapsack(sums: np.ndarray, batch: int):
    """g[cap] = min over multisets of group sizes summing to `batch` of sum sums[cap, b - 1];
    also the group size chosen last at every (cap, n), to rebuild the multiset."""
    C = sums.shape[0]
    G = np.full((C, batch + 1), np.inf)
    G[:, 0] = 0.0
    choice = np.zeros((C, batch + 1), dtype=np.int64)
    for n in range(1, batch + 1):
        for b in range(1, n + 1):
            cand = G[:, n - b] + sums[:, b - 1]
            better = cand < G[:, n]
            G[better, n] = cand[better]
            choice[better, n] = b
    return G[:, batch], choice
