"""The schedule searches' fast replay of fixed per-rank op orders.

`replay` applies the rules of `simulator.simulate` (one compute stream per rank, one link per
directed rank pair, the same processing order) to plain lists and keeps only the makespan and
the per-rank activation peaks, so a candidate costs a fraction of a full simulation; it also
stops as soon as the candidate cannot win. The searches replay every candidate and simulate
only the winner. One function serves one stage per rank (1F1B, the adaptive schedule and token
slices: `stage_to_rank` is the identity) and several (interleaved: `stage_to_rank[s] = s % PP`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError

# A candidate is dropped when a rank's peak passes its limit by more than this (MB). The limits
# (device memory less model states) and the planner's fit estimates are float sums taken in
# another order than the replay's running sum of kept activations, so a schedule that fills a
# rank exactly can read a few ulps over; 1e-6 MB (one byte) is far below any activation, so the
# slack admits only those. Every search uses the same slack (the interleaved one used to add it
# to its limits itself), and the brute-force checks in tests/planner compare peaks with it.
MEM_SLACK_MB = 1e-6


def cost_lists(costs: PipelineCosts):
    """`costs` as the nested lists `replay` reads (built once per search, not per candidate)."""
    comm = costs.comm.tolist()
    gcomm = comm if costs.grad_comm is None else costs.grad_comm.tolist()
    return (costs.fwd.tolist(), costs.bwd.tolist(), costs.stored.tolist(), costs.transient.tolist(), comm, gcomm,
            bool(costs.grad_comm is not None and costs.grad_comm_epilogue_only))


def replay(c, orders: List[List[ComputeOp]], stage_to_rank: Optional[Sequence[int]] = None, cut: float = float("inf"),
           mem_limit: Optional[Sequence[float]] = None):
    """(makespan, per-rank activation peak) of `simulate(costs, orders, stage_to_rank)`, with
    `c = cost_lists(costs)` and `orders` per rank (stage_to_rank None: stage s on rank s).
    None once an op would end at or after `cut`, or a rank's memory would pass `mem_limit`
    (+ MEM_SLACK_MB); raises SimulationError on a deadlock."""
    fwd, bwd, stored, trans, comm, gcomm, epilogue_only = c
    S, K, R = len(fwd), len(fwd[0]), len(orders)
    rank = range(S) if stage_to_rank is None else stage_to_rank
    # Per stage, where its output goes: the index of the link (src * R + dst) that carries it,
    # -1 to the next stage on the same rank (no transfer), -2 nowhere (last stage forward,
    # first stage backward). One list lookup replaces the stage-boundary test.
    f_link = [-2 if s == S - 1 else -1 if rank[s + 1] == rank[s] else rank[s] * R + rank[s + 1] for s in range(S)]
    b_link = [-2 if s == 0 else -1 if rank[s - 1] == rank[s] else rank[s] * R + rank[s - 1] for s in range(S)]
    last_f = [max((i for i, o in enumerate(order) if o[0] == "F"), default=-1) if epilogue_only else -1
              for order in orders]
    f_end = [[-1.0] * K for _ in range(S)]
    # When mb's activation / gradient is available on stage s (-1: not yet). Stage 0's inputs
    # and the last stage's (absent) gradients count as there from time 0: an op's start is
    # the max of its rank's free time (>= 0) and its inputs, so a 0 changes no time and
    # spares a stage test per op.
    arr_f = [[0.0 if s == 0 else -1.0] * K for s in range(S)]
    arr_b = [[0.0 if s == S - 1 else -1.0] * K for s in range(S)]
    link = [0.0] * (R * R)  # when each directed rank pair's link is free
    free, mem, peak, ptr = [0.0] * R, [0.0] * R, [0.0] * R, [0] * R
    remaining, makespan = sum(len(o) for o in orders), 0.0
    limit = [float("inf")] * R if mem_limit is None else [float(m) + MEM_SLACK_MB for m in mem_limit]
    # Hot loop (a search replays thousands of candidates): a rank's state lives in locals while
    # it runs ops and is written back when it waits; `b if b > a else a` is `max(a, b)` (same
    # value and tie rule) without the call.
    while remaining:
        progressed = False
        for r in range(R):
            order, p = orders[r], ptr[r]
            n = len(order)
            if p == n:
                continue
            p0, t, m, pk, lim, lf = p, free[r], mem[r], peak[r], limit[r], last_f[r]
            while p < n:
                kind, mb, s = order[p]
                if kind == "F":
                    a = arr_f[s][mb]
                    if a < 0:
                        break
                    t1 = (a if a > t else t) + fwd[s][mb]
                    st = stored[s][mb]
                    hi = m + st + trans[s][mb]
                    m += st
                    f_end[s][mb] = t1
                    x = f_link[s]
                    if x >= 0:
                        y = link[x]
                        link[x] = arr_f[s + 1][mb] = (y if y > t1 else t1) + comm[s][mb]
                    elif x == -1:
                        arr_f[s + 1][mb] = t1
                else:
                    fe, a = f_end[s][mb], arr_b[s][mb]
                    if fe < 0 or a < 0:
                        break
                    t0 = fe if fe > t else t
                    t1 = (a if a > t0 else t0) + bwd[s][mb]
                    hi = m + trans[s][mb]
                    m -= stored[s][mb]
                    x = b_link[s]
                    if x >= 0:
                        y = link[x]
                        table = gcomm if p > lf else comm
                        link[x] = arr_b[s - 1][mb] = (y if y > t1 else t1) + table[s - 1][mb]
                    elif x == -1:
                        arr_b[s - 1][mb] = t1
                if t1 >= cut:
                    return None
                if hi > pk:
                    if hi > lim:
                        return None
                    pk = hi
                t = t1
                if t1 > makespan:
                    makespan = t1
                p += 1
            if p > p0:
                ptr[r], free[r], mem[r], peak[r] = p, t, m, pk
                remaining -= p - p0
                progressed = True
        if not progressed:
            raise SimulationError("schedule deadlocks")
    return makespan, peak
