"""Zero-bubble pipeline schedules: the backward split into its input gradient (I, on the
critical path: the gradient the previous stage waits for) and its weight gradient (W, which
nothing waits for), and W passes placed into the bubbles.

One greedy list scheduler writes every schedule here (after the heuristic of Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR'24): a rank that is free runs, in this order of
preference,

1. a ready I (the highest stage first: on a V its gradient unblocks the other ranks),
2. a ready F, if the rank keeps fewer forward graphs than its limit, less one for each later
   stage of that rank (the highest stage first, then the lowest micro-batch),
3. the oldest pending W (W passes run in the order of their I, so each parameter accumulates
   its micro-batches in the same order as under 1F1B: the gradients are bitwise 1F1B's),

and otherwise waits for the next arrival. A forward graph is kept from F to W, so the limit
bounds the activations plus the deferred weight-gradient state (`validate_plans(max_kept=)`
checks it on the lowered plans). The schedules differ only in stage placement and limits:

* ``zb-h1``: one stage per rank, limit ``min(p - r, m)`` on rank r: 1F1B's memory;
* ``zb-h2``: limit ``min(2p - 1 - r, m)``: more warm-up forwards, and every rank may defer its
  W passes into the drain, so on equal F/I/W costs only the fill ((p - 1) F) is left (ZB-H2);
* ``zb-v``: two stages per rank in a V (rank r runs stages r and 2p - 1 - r, so the first and
  the last stage share rank 0 and the turn is local on rank p-1), limit ``2p`` half-size
  graphs on every rank (1F1B's peak of rank 0), after Qi et al., "Pipeline Parallelism with
  Controllable Memory" (NeurIPS'24).

The scheduler runs on unit costs (F = I = W, the published assumption) unless given costs;
it is deterministic and yields per-rank `ComputeOp` orders for `lower_to_plans`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-v")


def stage_to_rank_of(schedule: str, pp: int) -> list:
    if schedule == "zb-v":
        return list(range(pp)) + list(range(pp - 1, -1, -1))
    return list(range(pp))


def kept_limits(schedule: str, pp: int, m: int) -> list:
    """Per rank, the most forward graphs (F run, W not yet) the schedule keeps at once."""
    if schedule == "zb-h1":
        return [min(pp - r, m) for r in range(pp)]
    if schedule == "zb-h2":
        return [min(2 * pp - 1 - r, m) for r in range(pp)]
    if schedule == "zb-v":
        return [min(2 * pp, 2 * m) for _ in range(pp)]
    raise ValueError(f"unknown zero-bubble schedule {schedule!r}; choose one of {ZB_SCHEDULES}")


def greedy_zb_orders(num_microbatches: int, stage_to_rank: Sequence[int], limits: Sequence[int],
                     cost: Optional[Callable[[str, int, int], float]] = None,
                     comm: Optional[Callable[[int, int], float]] = None, op_cls=None,
                     split: Optional[Callable[[int, int], bool]] = None, order: Optional[Sequence[int]] = None,
                     admit: Optional[Callable] = None, on_op: Optional[Callable] = None) -> list:
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
    after = [sum(1 for t in stages_of[stage_to_rank[s]] if t > s) for s in range(S)]
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
        if b_ready:
            s, mb = max(b_ready, key=lambda k: (k[0], -k[1]))
            del ready_b[r][(s, mb)]
            kind = "I" if split(mb, s) else "B"
            choice = (kind, mb, s)
        elif f_ready and any(kept[r] < limits[r] - after[s] for s, _ in f_ready):
            s, mb = max((k for k in f_ready if kept[r] < limits[r] - after[k[0]]), key=lambda k: (k[0], -k[1]))
            del ready_f[r][(s, mb)]
            next_f[s] += 1
            choice = ("F", mb, s)
        elif pending_w[r]:
            mb, s = pending_w[r].pop(0)
            choice = ("W", mb, s)
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


def zb_orders(schedule: str, num_microbatches: int, pp: int):
    """(per-rank compute orders, stage -> rank) of a zero-bubble schedule on unit costs."""
    if num_microbatches < 1 or pp < 1:
        raise ValueError(f"need micro-batches >= 1 and --pipeline-model-parallel-size >= 1, got "
                         f"{num_microbatches}, {pp}")
    stage_to_rank = stage_to_rank_of(schedule, pp)
    limits = kept_limits(schedule, pp, num_microbatches)
    return greedy_zb_orders(num_microbatches, stage_to_rank, limits), stage_to_rank
