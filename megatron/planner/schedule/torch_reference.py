"""PyTorch's own zero-bubble schedule generators as the reference the schedules here are held to.

`torch.distributed.pipelining.schedules` builds each schedule's per-rank action lists
(`pipeline_order`) in the constructor, from the stages' group size, rank and stage count alone:
no process group, no device, no model is touched until `step`. `torch_orders` constructs the
real schedule classes, as their users do, on stand-in stages that carry exactly those
attributes, and converts `pipeline_order` to this project's `ComputeOp` orders:

* ``"zb-h1"``: `ScheduleInterleavedZeroBubble` with one stage per rank (the paper's ZB-H1);
* ``"zb-v"``: `ScheduleZBVZeroBubble` (two stages per rank in a V);
* ``"dualpipev"``: `ScheduleDualPipeV` (its OVERLAP_F_B actions run their forward, then their
  full backward: one compute stream per rank, as the simulator has).

`unit_costs` prices a schedule the way the paper does (F = I = W = 1, a whole backward B = 2,
no communication; a V's stages are half a model slice each, so half of that), and
`replay_orders` times any per-rank orders with the project's simulator, returning the makespan
and the peak number of forward graphs a rank keeps (from F to its W, or its whole B).
"""
from __future__ import annotations

import types
from typing import Optional, Sequence

import numpy as np

from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, simulate

TORCH_CLASSES = {"zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}


def v_stage_to_rank(pp: int) -> list:
    """Rank of each of the 2 PP stages of a V: stages r and 2 PP - 1 - r on rank r (torch's "v")."""
    return list(range(pp)) + list(range(pp - 1, -1, -1))


def torch_orders(schedule: str, num_microbatches: int, pp: int):
    """(per-rank ComputeOp orders, stage -> rank) of torch's generator for `schedule`. Raises
    ValueError where torch refuses the point (ZB-H1 needs m to be a multiple of m // pp,
    DualPipeV at least 2 pp micro-batches)."""
    import torch
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_CLASSES[schedule])
    chunks = 1 if schedule == "zb-h1" else 2
    num_stages = pp * chunks
    s2r = list(range(pp)) if chunks == 1 else v_stage_to_rank(pp)

    def stage(rank, sid):  # what the constructors read of a `PipelineStage`
        return types.SimpleNamespace(group_size=pp, group_rank=rank, num_stages=num_stages, stage_index=sid,
                                     submod=torch.nn.Identity(), is_first=sid == 0, is_last=sid == num_stages - 1)

    sched = cls([stage(0, s) for s in range(num_stages) if s2r[s] == 0], num_microbatches)
    kinds = {"F": "F", "I": "I", "W": "W", "B": "B"}
    orders = []
    for r in range(pp):
        ops = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = kinds[sub.computation_type.value]  # KeyError: an action kind not priced here
                ops.append(ComputeOp(kind, sub.microbatch_index, sub.stage_index))
        orders.append(ops)
    return orders, s2r


def unit_costs(num_stages: int, m: int, chunk: float = 1.0, kept: float = 1.0) -> PipelineCosts:
    """F = I = W = `chunk`, B = 2 `chunk`, no communication; each forward keeps `kept` (one
    graph), held whole until its W (what the executor keeps)."""
    z = np.zeros((num_stages, m))
    return PipelineCosts(z + chunk, z + 2 * chunk, z + kept, z, z, wgrad=z + chunk)


def replay_orders(orders: Sequence[Sequence[ComputeOp]], stage_to_rank: Sequence[int], m: int,
                  costs: Optional[PipelineCosts] = None):
    """(makespan, per-rank peak of kept forward graphs) of `orders` under `costs` (default: the
    paper's unit costs, a V's stages at half; their `stored` is one graph per forward)."""
    S = len(stage_to_rank)
    unit = costs is None
    if unit:
        costs = unit_costs(S, m, chunk=1.0 if S == len(orders) else 0.5)
    res = simulate(costs, orders, stage_to_rank)
    peaks = res.peak_memory if unit else simulate(unit_costs(S, m), orders, stage_to_rank).peak_memory
    return res.makespan, [int(round(p)) for p in peaks]
