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

`search` simulates both schedules over a set of micro-batch orders and returns the fastest
one that fits in memory. The orders (`search_orders`): the first round's cheap ones (longest
first, shortest first), then every order of a few *clusters* of micro-batches, grouped
(k-means, deterministic start) by their first- and last-stage forward and backward times, the
quantities that decide how the pipeline fills and drains; inside a cluster the slowest run
first. With at most `exhaustive_up_to` micro-batches every order is tried, so the result is
the optimum over all orders and both schedules. Candidates are pruned by an order-specific
lower bound (the first micro-batch's fill time on each stage plus that stage's total work)
and a simulation stops as soon as it runs past the best makespan so far; the 1F1B candidates
are replayed with a list-based copy of the simulator's rules (`megatron.planner.schedule.replay`), and
only the winner is simulated in full. Deterministic: no random numbers, ties keep the earlier candidate.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron.planner.dynapipe.native import cpp as _cpp
from megatron.planner.schedule.orders import one_f_one_b
from megatron.planner.schedule.replay import cost_lists, replay
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimResult, SimulationError, simulate
from megatron.planner.schedule.zb_search import zb_candidate


class ScheduleInfeasible(RuntimeError):
    pass


def adaptive(costs: PipelineCosts, order: Sequence[int], mem_limit: Sequence[float]) -> List[List[ComputeOp]]:
    """Memory-aware wait-free schedule (one stage per rank). Raises ScheduleInfeasible if
    some micro-batch does not fit on a stage even when nothing else is in flight."""
    return _adaptive(costs, order, mem_limit)[0]


def _adaptive(costs, order, mem_limit, cut=float("inf")):
    """(per-stage orders, makespan); `simulate` on the orders reproduces the same times.
    Returns None as soon as an op would end at or after `cut` (it cannot beat that). Runs the
    C++ copy of `_adaptive_py` (megatron/planner/dynapipe/partition.cpp) when it is built."""
    if _cpp is None:
        return _adaptive_py(costs, order, mem_limit, cut)
    status, value, ops = _cpp.adaptive_schedule(
        costs.fwd, costs.bwd, costs.stored, costs.transient, costs.comm, _adaptive_grad_comm(costs),
        np.asarray(order, dtype=np.int64), np.asarray(mem_limit, dtype=np.float64) + 1e-9, float(cut))
    if status == 1:
        return None
    if status == 2:
        mb, s = value, ops
        raise ScheduleInfeasible(f"micro-batch {mb} needs {costs.stored[s][mb] + costs.transient[s][mb]:.0f} MB on "
                                 f"stage {s}, limit {mem_limit[s]:.0f} MB")
    orders = [[ComputeOp("F" if v & 1 else "B", v >> 1, s) for v in row] for s, row in enumerate(ops.tolist())]
    return orders, value


def _adaptive_grad_comm(costs: PipelineCosts) -> np.ndarray:
    """Gradient transfer times the adaptive schedule plans with. Epilogue-only compression
    depends on where each rank's last forward lands, which this greedy search only learns at
    the end: plan with uncompressed gradients then."""
    return costs.comm if costs.grad_comm is None or costs.grad_comm_epilogue_only else costs.grad_comm


def _adaptive_py(costs, order, mem_limit, cut=float("inf")):
    """The reference implementation of `_adaptive` (and its fallback when C++ is not built)."""
    S, K = costs.num_stages, len(order)
    fwd, bwd, stored, trans, comm = (a.tolist() for a in
                                     (costs.fwd, costs.bwd, costs.stored, costs.transient, costs.comm))
    gcomm = _adaptive_grad_comm(costs).tolist()
    limit = [m + 1e-9 for m in mem_limit]
    nmb = costs.num_microbatches
    fptr = [0] * S
    f_arrival = [[-1.0] * nmb for _ in range(S)]  # time mb's activation is here (-1: not yet)
    for mb in order:
        f_arrival[0][mb] = 0.0
    b_queue: List[list] = [[] for _ in range(S)]  # FIFO of (arrival, mb), read from b_head
    b_head = [0] * S
    free_at = [0.0] * S
    mem = [0.0] * S
    inflight: List[dict] = [dict() for _ in range(S)]  # mb -> transient
    inflight_max = [0.0] * S
    link_free = [0.0] * S  # link s->s+1 (activations) ...
    glink_free = [0.0] * S  # ... and s->s-1 (gradients)
    orders: List[List[ComputeOp]] = [[] for _ in range(S)]
    done = 0
    INF = float("inf")

    def candidate(s):
        """(start, is_forward) of the op stage s would run next, or None; backward first at
        equal start times."""
        bt = INF
        if b_head[s] < len(b_queue[s]):
            a, fr = b_queue[s][b_head[s]][0], free_at[s]
            bt = a if a > fr else fr
        if fptr[s] < K:
            mb = order[fptr[s]]
            a = f_arrival[s][mb]
            if a >= 0.0:
                tr, im = trans[s][mb], inflight_max[s]
                if mem[s] + stored[s][mb] + (tr if tr > im else im) <= limit[s]:
                    fr = free_at[s]
                    ft = a if a > fr else fr
                    if ft < bt:
                        return (ft, 1)
                elif not inflight[s]:
                    raise ScheduleInfeasible(
                        f"micro-batch {mb} needs {stored[s][mb] + trans[s][mb]:.0f} MB on stage {s}, "
                        f"limit {mem_limit[s]:.0f} MB"
                    )
        return (bt, 0) if bt < INF else None

    # S is small: keep each stage's next choice and take the earliest (backward first at
    # equal times, then lower stage); only stages whose inputs changed are re-evaluated.
    cand = [candidate(s) for s in range(S)]
    total = 2 * S * K
    makespan = 0.0
    while done < total:
        pick, ps = None, -1
        for x in range(S):
            c = cand[x]
            if c is not None and (pick is None or c < pick):
                pick, ps = c, x
        if pick is None:
            raise SimulationError("adaptive schedule stalled (no stage can run)")  # pragma: no cover
        t, is_f = pick
        s = ps
        if is_f:
            mb = order[fptr[s]]
            fptr[s] += 1
            t1 = t + fwd[s][mb]
            mem[s] += stored[s][mb]
            tr = trans[s][mb]
            inflight[s][mb] = tr
            if tr > inflight_max[s]:
                inflight_max[s] = tr
            orders[s].append(ComputeOp("F", mb, s))
            if s < S - 1:
                t0 = t1 if t1 > link_free[s] else link_free[s]
                link_free[s] = f_arrival[s + 1][mb] = t0 + comm[s][mb]
                cand[s + 1] = None  # re-evaluated below
            else:
                b_queue[s].append((t1, mb))
        else:
            mb = b_queue[s][b_head[s]][1]
            b_head[s] += 1
            t1 = t + bwd[s][mb]
            mem[s] -= stored[s][mb]
            gone = inflight[s].pop(mb)
            if gone >= inflight_max[s]:
                inflight_max[s] = max(inflight[s].values(), default=0.0)
            orders[s].append(ComputeOp("B", mb, s))
            if s > 0:
                t0 = t1 if t1 > glink_free[s] else glink_free[s]
                glink_free[s] = t0 + gcomm[s - 1][mb]
                b_queue[s - 1].append((t0 + gcomm[s - 1][mb], mb))
                cand[s - 1] = None
        free_at[s] = t1
        if t1 >= cut:
            return None
        if t1 > makespan:
            makespan = t1
        done += 1
        cand[s] = candidate(s)
        if s < S - 1 and is_f:
            cand[s + 1] = candidate(s + 1)
        elif s > 0 and not is_f:
            cand[s - 1] = candidate(s - 1)
    return orders, makespan


@dataclass
class ScheduleChoice:
    name: str  # "1f1b" or "adaptive"
    order: List[int]  # micro-batch order (indices into the costs' columns)
    orders: List[List[ComputeOp]]  # per stage
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


def cluster_orders(costs: PipelineCosts, num_clusters: int = 3, iters: int = 12) -> List[List[int]]:
    """Every order of `num_clusters` clusters of micro-batches (k-means on first/last-stage
    forward and backward times, each feature scaled to [0, 1], centres started at quantiles
    of their sum); inside a cluster, slowest bottleneck first. Deterministic."""
    K = costs.num_microbatches
    k = min(num_clusters, K)
    if k <= 1:
        return []
    X = np.stack([costs.fwd[0], costs.bwd[0], costs.fwd[-1], costs.bwd[-1]], axis=1)
    X = X / np.maximum(X.max(axis=0), 1e-12)
    by_sum = np.argsort(X.sum(axis=1), kind="stable")
    centres = X[by_sum[np.linspace(0, K - 1, k).round().astype(int)]]
    assign = None
    for _ in range(iters):
        new = ((X[:, None, :] - centres[None]) ** 2).sum(axis=2).argmin(axis=1)
        if assign is not None and (new == assign).all():
            break
        assign = new
        for c in range(k):
            if (assign == c).any():
                centres[c] = X[assign == c].mean(axis=0)
    key = (costs.fwd + costs.bwd).max(axis=0)
    clusters = []
    for c in np.argsort(centres.sum(axis=1), kind="stable"):  # light to heavy
        members = np.nonzero(assign == c)[0]
        if len(members):
            clusters.append([int(m) for m in members[np.argsort(-key[members], kind="stable")]])
    return [[m for c in perm for m in clusters[c]] for perm in itertools.permutations(range(len(clusters)))]


def search_orders(costs: PipelineCosts, max_orders: int = 2, num_clusters: int = 3,
                  exhaustive_up_to: int = 4) -> List[List[int]]:
    """The candidate orders `search` tries, first-round ones first (ties keep those)."""
    K = costs.num_microbatches
    if K <= exhaustive_up_to:
        first = candidate_orders(costs, max_orders)
        rest = [list(p) for p in itertools.permutations(range(K))]
        return first + [o for o in rest if o not in first]
    out = candidate_orders(costs, max_orders)
    for o in cluster_orders(costs, num_clusters):
        if o not in out:
            out.append(o)
    return out


def lower_bound(costs: PipelineCosts) -> float:
    """A makespan no order or schedule can beat: on every stage s, all of its work, after the
    earliest any forward can reach it (fill) and before the quickest any gradient can get from
    it back to stage 0 (drain)."""
    comm = costs.comm
    gcomm = comm if costs.grad_comm is None else np.minimum(costs.grad_comm, comm)
    head = np.zeros_like(costs.fwd)
    head[1:] = np.cumsum(costs.fwd[:-1] + comm[:-1], axis=0)
    tail = np.zeros_like(costs.bwd)
    tail[1:] = np.cumsum(costs.bwd[:-1] + gcomm[:-1], axis=0)
    work = (costs.fwd + costs.bwd).sum(axis=1)
    return float((head.min(axis=1) + work + tail.min(axis=1)).max())


def search(costs: PipelineCosts, mem_limit: Sequence[float], orders: Optional[List[List[int]]] = None,
           schedules=("1f1b", "adaptive"), bound: float = float("inf"),
           max_orders: int = 2, num_clusters: int = 3, exhaustive_up_to: int = 4,
           polish_budget: Optional[int] = None) -> Optional[ScheduleChoice]:
    """Fastest (schedule, order) whose simulated peak fits `mem_limit` per stage, over
    `orders` (default `search_orders`).

    Returns None when nothing fits or nothing beats `bound` (a makespan to beat, so callers
    can stop early across recompute levels)."""
    S = costs.num_stages
    work = (costs.fwd + costs.bwd).sum(axis=1)
    # No schedule beats the busiest stage's total compute: skip the search if that loses.
    if float(work.max()) >= bound:
        return None
    if orders is None:
        orders = search_orders(costs, max_orders, num_clusters, exhaustive_up_to)
    # Stage s cannot start before the first micro-batch's forwards (and transfers) above it.
    head = np.zeros_like(costs.fwd)
    head[1:] = np.cumsum(costs.fwd[:-1] + costs.comm[:-1], axis=0)
    lists = cost_lists(costs)

    def run(name, order, cut):
        """(makespan, ops) of one candidate if it fits and ends before `cut`, else None."""
        if name == "1f1b":
            ops = one_f_one_b(S, order)
            got = replay(lists, ops, None, cut, mem_limit)
            return None if got is None else (got[0], ops)
        if name == "zb":  # split backward, W passes in the bubbles (megatron/planner/schedule/zb_search.py)
            return zb_candidate(costs, order, mem_limit, cut)
        try:  # fits by construction
            got = _adaptive(costs, order, mem_limit, cut)
        except ScheduleInfeasible:
            return None
        return None if got is None else (got[1], got[0])

    floor = lower_bound(costs) * (1.0 + 1e-12)  # reaching it proves the optimum: stop there
    best = None  # (makespan, name, order, ops)
    for order in orders:
        if best is not None and best[0] <= floor:
            break
        if float((head[:, order[0]] + work).max()) >= (bound if best is None else min(bound, best[0])):
            continue  # lower bound: cannot beat the best so far
        for name in schedules:
            got = run(name, order, bound if best is None else min(bound, best[0]))
            if got is not None:
                best = (got[0], name, list(order), got[1])
    # Polish the best order by swapping neighbours (under the best schedule type) while that
    # helps: at most `polish_budget` simulations (default one per two micro-batches, at most
    # 8), the swaps nearest the two ends of the order first; each stops once it runs past
    # the best.
    budget = min(8, costs.num_microbatches // 2) if polish_budget is None else polish_budget
    improved = best is not None and best[0] > floor
    while improved and budget > 0:
        improved = False
        n = len(best[2]) - 1
        # Fill and drain decide the bubbles: swaps near the two ends first.
        for i in sorted(range(n), key=lambda i: min(i, n - 1 - i)):
            if budget <= 0:
                break
            order = list(best[2])
            order[i], order[i + 1] = order[i + 1], order[i]
            if float((head[:, order[0]] + work).max()) >= best[0]:
                continue
            budget -= 1
            got = run(best[1], order, min(bound, best[0]) - 1e-9)
            if got is not None:
                best, improved = (got[0], best[1], order, got[1]), True
    if best is None:
        return None
    makespan, name, order, ops = best
    return ScheduleChoice(name, order, ops, simulate(costs, ops))
