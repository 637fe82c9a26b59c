"""Pipeline schedules over variable-size micro-batches, and the search over them.

* 1F1B (Megatron's order): stage s runs ``S-s-1`` warm-up forwards, then alternates one
  forward / one backward, then drains backwards. Memory is not consulted; the simulated peak
  is checked afterwards.
* Adaptive ("wait-free cyclic", after DynaPipe): an event-driven list scheduler. A free
  stage runs whatever is ready, backward first at equal times; a forward of a micro-batch
  is admitted only if the stage's kept activations plus its working set can never exceed the
  stage's memory limit, so the simulated memory stays under the limit by construction. Stages
  keep one forward order (the permutation) and run backwards in arrival order, so every rank
  pair sees sends and receives in the same order.

`search` simulates both schedules over a few micro-batch orders and returns the fastest one
that fits in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron.planner.simulator import Op, PipelineCosts, SimResult, SimulationError, simulate


class ScheduleInfeasible(RuntimeError):
    pass


def one_f_one_b(num_stages: int, order: Sequence[int]) -> List[List[Op]]:
    """Per-stage op orders of 1F1B for micro-batches run in `order`."""
    K = len(order)
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, K)
        ops = [Op("F", order[k], s) for k in range(warm)]
        for k in range(K - warm):
            ops.append(Op("F", order[warm + k], s))
            ops.append(Op("B", order[k], s))
        ops.extend(Op("B", order[k], s) for k in range(K - warm, K))
        out.append(ops)
    return out


def adaptive(costs: PipelineCosts, order: Sequence[int], mem_limit: Sequence[float]) -> List[List[Op]]:
    """Memory-aware wait-free schedule (one stage per rank). Raises ScheduleInfeasible if
    some micro-batch does not fit on a stage even when nothing else is in flight."""
    return _adaptive(costs, order, mem_limit)[0]


def _adaptive(costs, order, mem_limit):
    """(per-stage orders, makespan); `simulate` on the orders reproduces the same times."""
    S, K = costs.num_stages, len(order)
    fwd, bwd, stored, trans, comm = (a.tolist() for a in
                                     (costs.fwd, costs.bwd, costs.stored, costs.transient, costs.comm))
    # Epilogue-only compression depends on where each rank's last forward lands, which this
    # greedy search only learns at the end: plan with uncompressed gradients then.
    gcomm = comm if costs.grad_comm is None or costs.grad_comm_epilogue_only else costs.grad_comm.tolist()
    fptr = [0] * S
    f_arrival = [dict() for _ in range(S)]  # mb -> time its activation is here
    f_arrival[0] = {mb: 0.0 for mb in order}
    b_queue: List[list] = [[] for _ in range(S)]  # FIFO of (arrival, mb)
    free_at = [0.0] * S
    mem = [0.0] * S
    inflight: List[dict] = [dict() for _ in range(S)]  # mb -> transient
    inflight_max = [0.0] * S
    link_free = [0.0] * S  # link s->s+1 (activations) ...
    glink_free = [0.0] * S  # ... and s->s-1 (gradients)
    orders: List[List[Op]] = [[] for _ in range(S)]
    done = 0

    def candidate(s):
        """(start, is_forward) of the op stage s would run next, or None."""
        best = None
        if b_queue[s]:
            best = (max(free_at[s], b_queue[s][0][0]), 0)
        if fptr[s] < K:
            mb = order[fptr[s]]
            if mb in f_arrival[s]:
                worst = max(trans[s][mb], inflight_max[s])
                if mem[s] + stored[s][mb] + worst <= mem_limit[s] + 1e-9:
                    c = (max(free_at[s], f_arrival[s][mb]), 1)
                    best = c if best is None or c < best else best
                elif not inflight[s]:
                    raise ScheduleInfeasible(
                        f"micro-batch {mb} needs {stored[s][mb] + trans[s][mb]:.0f} MB on stage {s}, "
                        f"limit {mem_limit[s]:.0f} MB"
                    )
        return best

    # S is small: keep each stage's next choice and take the earliest (backward first at
    # equal times, then lower stage); only stages whose inputs changed are re-evaluated.
    cand = [candidate(s) for s in range(S)]
    total = 2 * S * K
    makespan = 0.0
    while done < total:
        pick = None
        for x in range(S):
            c = cand[x]
            if c is not None and (pick is None or c < pick[0]):
                pick = (c, x)
        if pick is None:
            raise SimulationError("adaptive schedule stalled (no stage can run)")  # pragma: no cover
        (t, is_f), s = pick
        touched = {s}
        if is_f:
            mb = order[fptr[s]]
            fptr[s] += 1
            t1 = t + fwd[s][mb]
            mem[s] += stored[s][mb]
            inflight[s][mb] = trans[s][mb]
            inflight_max[s] = max(inflight_max[s], trans[s][mb])
            orders[s].append(Op("F", mb, s))
            if s < S - 1:
                t0 = max(t1, link_free[s])
                link_free[s] = t0 + comm[s][mb]
                f_arrival[s + 1][mb] = t0 + comm[s][mb]
                touched.add(s + 1)
            else:
                b_queue[s].append((t1, mb))
        else:
            _, mb = b_queue[s].pop(0)
            t1 = t + bwd[s][mb]
            mem[s] -= stored[s][mb]
            gone = inflight[s].pop(mb)
            if gone >= inflight_max[s]:
                inflight_max[s] = max(inflight[s].values(), default=0.0)
            orders[s].append(Op("B", mb, s))
            if s > 0:
                t0 = max(t1, glink_free[s])
                glink_free[s] = t0 + gcomm[s - 1][mb]
                b_queue[s - 1].append((t0 + gcomm[s - 1][mb], mb))
                touched.add(s - 1)
        free_at[s] = t1
        makespan = max(makespan, t1)
        done += 1
        for x in touched:
            cand[x] = candidate(x)
    return orders, makespan


@dataclass
class ScheduleChoice:
    name: str  # "1f1b" or "adaptive"
    order: List[int]  # micro-batch order (indices into the costs' columns)
    orders: List[List[Op]]  # per stage
    result: SimResult


def candidate_orders(costs: PipelineCosts, limit: int = 4) -> List[List[int]]:
    """A few cheap micro-batch orders: as given (longest first), shortest first, slowest
    bottleneck first, and long/short alternating (lets short ones fill bubbles)."""
    K = costs.num_microbatches
    ident = list(range(K))
    key = (costs.fwd + costs.bwd).max(axis=0)
    by_time = [int(i) for i in np.argsort(-key, kind="stable")]
    alt = []
    lo, hi = 0, K - 1
    while lo <= hi:
        alt.append(by_time[lo])
        if lo != hi:
            alt.append(by_time[hi])
        lo, hi = lo + 1, hi - 1
    out = []
    for o in (ident, ident[::-1], by_time, alt):
        if o not in out:
            out.append(o)
    return out[:limit]


def search(costs: PipelineCosts, mem_limit: Sequence[float], orders: Optional[List[List[int]]] = None,
           schedules=("1f1b", "adaptive"), bound: float = float("inf"),
           max_orders: int = 4) -> Optional[ScheduleChoice]:
    """Fastest (schedule, order) whose simulated peak fits `mem_limit` per stage.

    Returns None when nothing fits or nothing beats `bound` (a makespan to beat, so callers
    can stop early across recompute levels)."""
    S = costs.num_stages
    # No schedule beats the busiest stage's total compute: skip the search if that loses.
    if float((costs.fwd + costs.bwd).sum(axis=1).max()) >= bound:
        return None
    best = None  # (makespan, name, order, ops, SimResult or None)
    for order in orders or candidate_orders(costs, max_orders):
        for name in schedules:
            if name == "1f1b":
                ops = one_f_one_b(S, order)
                res = simulate(costs, ops)
                if any(p > m + 1e-6 for p, m in zip(res.peak_memory, mem_limit)):
                    continue
                makespan = res.makespan
            else:
                try:  # fits by construction; simulated below only if it wins
                    ops, makespan = _adaptive(costs, order, mem_limit)
                except ScheduleInfeasible:
                    continue
                res = None
            if makespan < bound and (best is None or makespan < best[0]):
                best = (makespan, name, list(order), ops, res)
    if best is None:
        return None
    makespan, name, order, ops, res = best
    return ScheduleChoice(name, order, ops, res if res is not None else simulate(costs, ops))
