"""Zero-bubble pipeline schedules: the backward split into its input gradient (I, on the
critical path: the gradient the previous stage waits for) and its weight gradient (W, which
nothing waits for), and W passes placed into the bubbles.

One greedy list scheduler writes every schedule here (after the heuristic of Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR'24): a rank that is free runs one of

* a ready I (the highest stage first: on a V its gradient unblocks the other ranks),
* a ready F, if the rank keeps fewer forward graphs than its limit (on a V, optionally less
  one for each later stage of that rank; the highest stage first, then the lowest micro-batch),
* the oldest pending W (W passes run in the order of their I, so each parameter accumulates
  its micro-batches in the same order as under 1F1B: the gradients are bitwise 1F1B's),

in the order its policy (`PREFERENCES`) gives for the kind of op it ran last, and otherwise
waits for the next arrival. A forward graph is kept from F to W, so the limit bounds the
activations plus the deferred weight-gradient state (`validate_plans(max_kept=)` checks it on
the lowered plans). `zb_orders` replays a few policies (`PORTFOLIO`) on unit costs and keeps the
first that reaches the bound (each rank's work plus the (p - 1) fill), else the shortest. The
schedules differ in stage placement and kept-graph limits:

* ``zb-h1``: one stage per rank, limit ``min(p, m)`` on every rank: 1F1B's peak (rank 0 keeps
  p graphs under 1F1B), the paper's ZB-H1 and torch's `ScheduleInterleavedZeroBubble`; its
  unit-cost bubble is the paper's (p - 1)(F + I - W) = p - 1;
* ``zb-h2``: limit ``min(2p - 1 - r, m)``: more warm-up forwards, and every rank may defer its
  W passes into the drain (ZB-H2); on equal F/I/W costs it ties with zb-h1, and it gains where
  W is cheaper or dearer than F;
* ``zb-v``: two stages per rank in a V (rank r runs stages r and 2p - 1 - r, so the first and
  the last stage share rank 0 and the turn is local on rank p-1), limit ``2p`` half-size
  graphs on every rank (1F1B's peak of rank 0), after Qi et al., "Pipeline Parallelism with
  Controllable Memory" (NeurIPS'24) and torch's `ScheduleZBVZeroBubble`;
* ``dualpipev``: the same V placement with DualPipeV's limit, ``2p + 1`` half-size graphs (one
  more than ZB-V: DeepSeek-V3's DualPipe folded onto p ranks, torch's `ScheduleDualPipeV`).
  DualPipeV pairs a forward of one chunk with a backward of the other so one's communication
  hides under the other's compute; with one compute stream per rank (as here and in the
  simulator) a pair runs as its two ops, so the order is what differs, not the kernels.

`torch_reference` builds torch's own action lists for the comparison (a test holds every
schedule here at or below torch's unit-cost makespan, and at or below its peak kept graphs).
The scheduler runs on unit costs (F = I = W, the published assumption) unless given costs;
it is deterministic and yields per-rank `ComputeOp` orders for `lower_to_plans`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

from megatron.config.schedules import SPLIT_SCHEDULES as ZB_SCHEDULES, V_SCHEDULES  # noqa: F401 (re-exported)

# Per policy of the greedy, per kind of the rank's last op ("B" is a whole backward), the order
# in which the rank looks for a ready op: "input-first" is the paper's heuristic (the default,
# which DynaPipe's searches use); "alternate" keeps 1F1B's steady F, I, F, I and runs W passes in
# what is left; "defer-input" runs forwards back to back and a W before the next I.
PREFERENCES = {
    "input-first": dict(F="IFW", I="IFW", B="IFW", W="IFW"),
    "alternate": dict(F="IFW", I="FIW", B="FIW", W="FIW"),
    "defer-input": dict(F="FWI", I="FIW", B="FIW", W="FIW"),
}


def stage_to_rank_of(schedule: str, pp: int) -> list:
    if schedule in V_SCHEDULES:
        return list(range(pp)) + list(range(pp - 1, -1, -1))
    return list(range(pp))


def kept_limits(schedule: str, pp: int, m: int) -> list:
    """Per rank, the most forward graphs (F run, W not yet) the schedule keeps at once (a V's
    graphs are of half a model slice each)."""
    if schedule == "zb-h1":
        return [min(pp, m)] * pp
    if schedule == "zb-h2":
        return [min(2 * pp - 1 - r, m) for r in range(pp)]
    if schedule == "zb-v":
        return [min(2 * pp, 2 * m)] * pp
    if schedule == "dualpipev":
        return [min(2 * pp + 1, 2 * m)] * pp
    raise ValueError(f"unknown zero-bubble schedule {schedule!r}; choose one of {ZB_SCHEDULES}")


def greedy_zb_orders(num_microbatches: int, stage_to_rank: Sequence[int], limits: Sequence[int],
                     cost: Optional[Callable[[str, int, int], float]] = None,
                     comm: Optional[Callable[[int, int], float]] = None, op_cls=None,
                     split: Optional[Callable[[int, int], bool]] = None, order: Optional[Sequence[int]] = None,
                     admit: Optional[Callable] = None, on_op: Optional[Callable] = None,
                     prefer: str = "input-first", reserve: bool = True) -> list:
    """Per-rank orders of F / I / W ops (`op_cls(kind, mb, stage)`) chosen by the greedy rules
    of the module docstring. `cost(kind, mb, stage)`: op time (default 1, a whole B 2);
    `comm(mb, stage)`: transfer time of stage's output (and of the gradient back; default 0).
    `split(mb, stage)` False keeps that backward whole (one "B", no W). `order`: the forward
    order of the micro-batches on every stage (default 0..m-1). `admit(rank, mb, stage)`: an
    extra test a forward must pass (DynaPipe's memory limit), `on_op(rank, kind, mb, stage)`
    sees every op chosen. Raises ValueError when the limits leave every rank waiting."""
    if op_cls is None:
        from megatron.pipeline.lowering import ComputeOp as op_cls
    cost = cost or (lambda kind, mb, s: 2.0 if kind == "B" else 1.0)
    comm = comm or (lambda mb, s: 0.0)
    split = split or (lambda mb, s: True)
    m, S = num_microbatches, len(stage_to_rank)
    R = max(stage_to_rank) + 1
    stages_of = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(R)]
    # A forward of a stage keeps a slot free for each later stage of its rank (a V): graphs
    # that wait for that stage must not take all the room it needs.
    after = [sum(1 for t in stages_of[stage_to_rank[s]] if t > s) if reserve else 0 for s in range(S)]
    ready_f = [dict() for _ in range(R)]   # (stage, mb) -> time its input is here
    ready_b = [dict() for _ in range(R)]
    order = list(range(m)) if order is None else list(order)
    next_f = {s: 0 for s in range(S)}       # forwards of a stage run in `order`
    for r in range(R):
        if 0 in stages_of[r]:
            ready_f[r][(0, order[0])] = 0.0
    pending_w = [[] for _ in range(R)]      # FIFO of (mb, stage) whose I ran
    kept = [0] * R
    free_at = [0.0] * R
    idle = [False] * R  # waiting for an arrival nobody has produced yet
    orders = [[] for _ in range(R)]
    left = [sum(3 if split(mb, s) else 2 for s in stages_of[r] for mb in range(m)) for r in range(R)]

    def deliver(kind, mb, s, t):
        dst = stage_to_rank[s]
        (ready_f if kind == "F" else ready_b)[dst][(s, mb)] = t
        if idle[dst]:
            idle[dst] = False
            free_at[dst] = max(free_at[dst], t)

    while any(left):
        # Discrete events: the busy rank with the earliest clock decides next, so every
        # arrival up to its clock is known when it does.
        active = [x for x in range(R) if left[x] and not idle[x]]
        if not active:
            blocked = {x: (kept[x], limits[x]) for x in range(R) if left[x]}
            raise ValueError(f"zero-bubble schedule stuck: every rank waits (rank: (kept graphs, limit) = "
                             f"{blocked}); raise the kept-graph limits")
        r = min(active, key=lambda x: (free_at[x], x))
        now = free_at[r]
        b_ready = [k for k, t in ready_b[r].items() if t <= now]
        f_ready = [k for k, t in ready_f[r].items() if t <= now and k[1] == order[next_f[k[0]]]
                   and (admit is None or admit(r, k[1], k[0]))]
        choice = None
        f_ok = [k for k in f_ready if kept[r] < limits[r] - after[k[0]]]
        last = orders[r][-1].kind if orders[r] else "W"
        for want in PREFERENCES[prefer][last]:
            if want == "I" and b_ready:
                s, mb = max(b_ready, key=lambda k: (k[0], -k[1]))
                del ready_b[r][(s, mb)]
                choice = ("I" if split(mb, s) else "B", mb, s)
            elif want == "F" and f_ok:
                s, mb = max(f_ok, key=lambda k: (k[0], -k[1]))
                del ready_f[r][(s, mb)]
                next_f[s] += 1
                choice = ("F", mb, s)
            elif want == "W" and pending_w[r]:
                mb, s = pending_w[r].pop(0)
                choice = ("W", mb, s)
            if choice is not None:
                break
        if choice is None:
            later = [t for t in list(ready_b[r].values()) + list(ready_f[r].values()) if t > now]
            if later:
                free_at[r] = min(later)
            else:
                idle[r] = True
            continue
        kind, mb, s = choice
        if on_op is not None:
            on_op(r, kind, mb, s)
        t1 = now + cost(kind, mb, s)
        free_at[r] = t1
        orders[r].append(op_cls(kind, mb, s))
        left[r] -= 1
        if kind == "F":
            kept[r] += 1
            if s + 1 < S:
                deliver("F", mb, s + 1, t1 + (0.0 if stage_to_rank[s + 1] == r else comm(mb, s)))
            else:
                deliver("B", mb, s, t1)
            if next_f[s] < m and s == 0:
                ready_f[r][(0, order[next_f[0]])] = 0.0
        elif kind in ("I", "B"):
            if kind == "I":
                pending_w[r].append((mb, s))
            else:
                kept[r] -= 1
            if s > 0:
                deliver("B", mb, s - 1, t1 + (0.0 if stage_to_rank[s - 1] == r else comm(mb, s - 1)))
        else:
            kept[r] -= 1
    return orders


# The greedy variants `zb_orders` tries in turn until one reaches the unit-cost bound: (policy,
# whether a V's first-chunk forwards keep a slot free for each later chunk of the rank). On the
# grid PP 2, 4, 8 x micro-batches PP..4 PP (tests/planner/schedule/test_zb_vs_torch.py) one of the
# first three reaches the bound at every point; the last (the original rules, which keep the
# slot) is the fallback where the others get stuck.
PORTFOLIO = (("alternate", False), ("input-first", False), ("defer-input", False), ("input-first", True))


def _replay(orders, stage_to_rank, m, costs=None):
    """(makespan, peak kept memory) of `orders` under `costs` (None: unit costs, F = I = W = 1,
    B = 2, one unit kept per forward)."""
    import numpy as np

    from megatron.planner.schedule.simulator import PipelineCosts, simulate
    if costs is None:
        z = np.zeros((len(stage_to_rank), m))
        costs = PipelineCosts(z + 1, z + 2, z + 1, z, z, wgrad=z + 1)
    res = simulate(costs, orders, stage_to_rank)
    return res.makespan, max(res.peak_memory)


def _search(schedule: str, m: int, pp: int, costs=None):
    from megatron.pipeline.lowering import ComputeOp
    s2r = stage_to_rank_of(schedule, pp)
    limits = kept_limits(schedule, pp, m)
    variants, cost, bound = PORTFOLIO, None, float("-inf")
    if costs is None:
        # No order beats the last rank's work plus the fill before its first forward (unit costs).
        bound = 3 * m * (len(s2r) // pp) + pp - 1
    else:  # the greedy clocks ops by the table, and every variant is tried
        f, b, w = costs.fwd, costs.bwd, costs.wgrad
        variants = [(prefer, reserve) for prefer in PREFERENCES for reserve in (False, True)]

        def cost(kind, mb, s):
            return float({"F": f[s, mb], "B": b[s, mb], "I": b[s, mb] - w[s, mb], "W": w[s, mb]}[kind])
    best, why = None, None
    for prefer, reserve in variants:
        try:
            orders = greedy_zb_orders(m, s2r, limits, op_cls=ComputeOp, prefer=prefer, reserve=reserve, cost=cost)
        except ValueError as e:  # these limits leave this variant stuck; another may pass
            why = e
            continue
        key = _replay(orders, s2r, m, costs)
        if best is None or key < best[0]:
            best = (key, tuple(tuple(o) for o in orders))
        if key[0] <= bound:
            break
    if costs is not None:
        # The unit-cost orders compete too: an estimated table (zb_costs.py) can mislead the
        # greedy where equal costs would not (zb-h1 at PP 4, m 8 on the A100 table).
        try:
            unit = _best_orders(schedule, m, pp)[0]
        except ValueError:
            unit = None
        if unit is not None:
            key = _replay([list(o) for o in unit], s2r, m, costs)
            if best is None or key < best[0]:
                best = (key, unit)
    if best is None:
        raise why
    return best[1], tuple(s2r)


_best_orders = functools.lru_cache(maxsize=256)(_search)


def zb_orders(schedule: str, num_microbatches: int, pp: int, costs=None):
    """(per-rank compute orders, stage -> rank) of a zero-bubble schedule: of the `PORTFOLIO`
    greedy variants under the schedule's kept-graph limits, the one with the shortest unit-cost
    replay (then the lowest peak). With `costs` (a `PipelineCosts` with `wgrad`, per stage of
    the schedule's placement) every variant runs on those costs, and they and the unit-cost
    orders are simulated on them: the shortest wins (what the runtime runs, `zb_costs.py`)."""
    if num_microbatches < 1 or pp < 1:
        raise ValueError(f"need micro-batches >= 1 and --pipeline-model-parallel-size >= 1, got "
                         f"{num_microbatches}, {pp}")
    if costs is None:
        orders, s2r = _best_orders(schedule, num_microbatches, pp)
    else:
        orders, s2r = _search(schedule, num_microbatches, pp, costs)
    return [list(o) for o in orders], list(s2r)
