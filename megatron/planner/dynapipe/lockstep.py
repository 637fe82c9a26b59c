"""DynaPipe plans for expert parallelism (issue 47): EP ranks are data-parallel ranks, and every
MoE layer's all-to-all pairs their i-th forward (and backward) passes, so each DP group must run
the same number of micro-batches with the same sequence of compute passes per pipeline rank.
DynaPipe balances the groups' times, not their counts: with `DynaPipeConfig.lockstep_groups` the
planner (`megatron.planner.dynapipe.planner`) cuts the partition into a multiple of DP
micro-batches (`equalize`: the micro-batch with the most samples is split, its cost re-read from
the segment-time table, so memory feasibility is kept: a part is never costlier than the whole),
deals them out with equal counts (`balance_equal`), and checks the emitted plans
(`check_lockstep`). Which micro-batch meets which at a step is `expert_load.pair_by_load`'s
business; this module only makes the steps exist.
"""
from __future__ import annotations

import heapq
from typing import List, Sequence

import numpy as np

from megatron.planner.dynapipe.partitioner import Partition, PartitionError


def equalize(p: Partition, seg_time: np.ndarray, dp: int) -> Partition:
    """`p` with micro-batches split (most samples first) until their count divides by `dp`.
    `seg_time` (N, M): the table `optimal_partition` cut, [i, m-1] = time of segment [i, i+m)."""
    b = list(p.boundaries)
    while (len(b) - 1) % dp:
        k = max(range(len(b) - 1), key=lambda j: (b[j + 1] - b[j], -j))
        if b[k + 1] - b[k] < 2:
            raise PartitionError(f"{len(b) - 1} single-sample micro-batches cannot be dealt equally to {dp} "
                                 "data-parallel groups (expert parallelism runs them in lockstep)")
        b.insert(k + 1, (b[k] + b[k + 1]) // 2)
    if len(b) == len(p.boundaries):
        return p
    times = [float(seg_time[b[k], b[k + 1] - b[k] - 1]) for k in range(len(b) - 1)]
    return Partition(b, times, p.objective)


def balance_equal(times: Sequence[float], k: int) -> List[List[int]]:
    """k groups of exactly len(times)/k items of similar total time (longest first to the lightest
    group with room), each in increasing index order, ordered by first item like `balance_groups`."""
    n = len(times)
    if n % k:
        raise PartitionError(f"{n} micro-batches cannot be dealt equally to {k} data-parallel groups")
    heap = [(0.0, g) for g in range(k)]
    groups: List[List[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda i: -float(times[i])):
        full = []
        while True:
            load, g = heapq.heappop(heap)
            if len(groups[g]) < n // k:
                break
            full.append((load, g))
        groups[g].append(i)
        heapq.heappush(heap, (load + float(times[i]), g))
        for x in full:
            heapq.heappush(heap, x)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def check_lockstep(plan) -> None:
    """Every DP group's pipeline rank r runs the same sequence of (pass kind, stage): the expert
    exchange of its i-th pass meets the other groups' i-th pass."""
    ref = plan.groups[0]
    for d, g in enumerate(plan.groups[1:], 1):
        for r, (a, b) in enumerate(zip(ref.compute_orders, g.compute_orders)):
            ka, kb = [(x.kind, x.stage) for x in a], [(x.kind, x.stage) for x in b]
            if ka != kb:
                raise RuntimeError(f"iteration {plan.iteration}: DP group {d}'s pipeline rank {r} runs its passes "
                                   f"in another order than group 0's ({len(kb)} vs {len(ka)} passes): expert "
                                   "parallelism needs them in lockstep (plan with schedules=('1f1b',))")
