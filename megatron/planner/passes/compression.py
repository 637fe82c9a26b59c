"""Which gradient messages of a plan are compressed (Optimus-CC compressed backpropagation).

A planner pass: it sets `compress_rank` on both ends of the chosen `SendGrad*`/`RecvGrad*`
instructions of all pipeline ranks' plans. The compressor and the wire layout it implies live
in `megatron.compression.pipeline` (below the executor that runs them); this pass lives with
the planners because it rewrites their instruction streams.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from megatron.pipeline import instructions as I


def mark_compressed_grads(plans: List[I.ExecutionPlan], rank: int,
                          epilogue_only: bool = False) -> List[I.ExecutionPlan]:
    """Set `compress_rank` on the gradient messages to compress, on both ends.

    `plans` are all pipeline ranks' plans of one iteration (one data-parallel group). A
    message is named by (micro-batch, sending stage); the sender's Start/Finish and the
    receiver's Start/Finish of that message all get the same rank."""
    if rank <= 0:
        return plans
    chosen = set()
    for plan in plans:
        last_forward = -1
        if epilogue_only:
            for i, ins in enumerate(plan.instructions):
                if isinstance(ins, I.ForwardPass):
                    last_forward = i
        for i, ins in enumerate(plan.instructions):
            if isinstance(ins, I.SendGradStart) and i > last_forward:
                chosen.add((ins.microbatch, ins.stage))
    grad_comm = (I.SendGradStart, I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish)
    out = []
    for plan in plans:
        instrs = [dataclasses.replace(ins, compress_rank=rank)
                  if isinstance(ins, grad_comm) and (ins.microbatch, ins.stage) in chosen else ins
                  for ins in plan.instructions]
        out.append(dataclasses.replace(plan, instructions=instrs))
    return out


def grad_compression_pass(cfg) -> Optional[Callable[[list], list]]:
    """The plan pass for this run's flags, or None when compressed backpropagation is off."""
    c = getattr(cfg, "compression", None)
    if c is None or not c.inter_grad_comp:
        return None
    rank, epilogue = c.inter_grad_comp_rank, c.inter_grad_comp_epilogue_only
    return lambda plans: mark_compressed_grads(plans, rank, epilogue)
