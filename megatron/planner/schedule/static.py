"""Static (Megatron-LM baseline) pipeline schedules as compute orders, lowered to plans.

Schedules (names accepted by `build_static_plans`):

* ``"gpipe"``: every forward, then every backward in reverse micro-batch order (GPipe);
  ``"gpipe-fifo"``: the same with backwards in forward order (what Megatron's
  non-interleaved schedule degenerates to with all micro-batches in warm-up).
* ``"1f1b"``: Megatron's non-interleaved schedule (PipeDream-Flush): rank r runs
  ``min(PP - r - 1, m)`` warm-up forwards, then alternates one forward / one backward, then
  drains the remaining backwards. At most ``PP - r`` forwards are in flight on rank r.
* ``"interleaved"``: Megatron's interleaved 1F1B with ``v`` model chunks per rank; chunk k of
  rank r is stage ``k * PP + r``. Any micro-batch count: when PP does not divide it, the
  remainder joins the last group of PP (`interleaved_order`).

* ``"zb-h1"``, ``"zb-h2"``, ``"zb-v"``, ``"dualpipev"``: zero-bubble schedules with the backward
  split into input- and weight-gradient passes (`megatron.planner.schedule.zero_bubble`); zb-v
  and dualpipev place two stages per rank in a V.

Stage ids are global virtual stages; `stage_to_rank(s) = s % PP` (zb-v, dualpipev: a V, see
zero_bubble).
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

from megatron.pipeline.instructions import ExecutionPlan
from megatron.pipeline.lowering import ComputeOp, lower_to_plans
from megatron.models.stage_split import stage_layer_split  # noqa: F401 (re-exported)
from megatron.planner.schedule.interleaved_order import interleaved_op_orders
from megatron.planner.schedule.orders import one_f_one_b
from megatron.planner.schedule.zero_bubble import V_SCHEDULES, ZB_SCHEDULES, zb_orders

SCHEDULES = ("gpipe", "gpipe-fifo", "1f1b", "interleaved") + ZB_SCHEDULES


def gpipe_orders(num_microbatches: int, pp: int, reverse_backward: bool = True):
    """Per rank: F(0..m-1) then B in reverse (GPipe) or forward order."""
    m = num_microbatches
    back = range(m - 1, -1, -1) if reverse_backward else range(m)
    return [[ComputeOp("F", mb, r) for mb in range(m)] + [ComputeOp("B", mb, r) for mb in back]
            for r in range(pp)]


def one_f_one_b_orders(num_microbatches: int, pp: int):
    """Megatron's `forward_backward_pipelining_without_interleaving` order per rank."""
    return one_f_one_b(pp, range(num_microbatches))


def interleaved_orders(num_microbatches: int, pp: int, num_model_chunks: int):
    """Megatron's `forward_backward_pipelining_with_interleaving` order per rank.

    Virtual micro-batch k (k-th forward, or k-th backward, of a rank) runs model chunk
    ``(k % (PP*v)) // PP`` (reversed for backward) on micro-batch
    ``(k // (PP*v)) * PP + k % PP``: groups of PP micro-batches go through all chunks before
    the next group starts. Warm-up is ``(PP - r - 1) * 2 + (v - 1) * PP`` virtual forwards
    (everything when m == PP), then 1F1B over virtual micro-batches, then cool-down.
    Micro-batch counts that PP does not divide (packed rows, multi-task batches by tokens) run
    with the remainder in the last group (`interleaved_order`); a multiple of PP gives exactly
    Megatron's order.
    """
    return interleaved_op_orders(pp, num_model_chunks, range(num_microbatches), ComputeOp)


def static_orders(schedule: str, num_microbatches: int, pp: int, num_model_chunks: int = 1, zb_costs=None):
    """Compute orders and stage -> rank map for a static schedule name. `zb_costs`: the
    per-stage `PipelineCosts` a zero-bubble schedule's greedy is clocked by (`zb_costs.py`;
    None: unit costs)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if num_microbatches < 1 or pp < 1 or num_model_chunks < 1:
        raise ValueError(f"need micro-batches >= 1, --pipeline-model-parallel-size >= 1 and "
                         f"model chunks >= 1, got {num_microbatches}, {pp}, {num_model_chunks}")
    if schedule in ZB_SCHEDULES:
        want = 2 if schedule in V_SCHEDULES else 1
        if num_model_chunks != want:
            raise ValueError(f"schedule {schedule!r} runs {want} model chunk(s) per rank, not {num_model_chunks}")
        return zb_orders(schedule, num_microbatches, pp, zb_costs)
    if schedule != "interleaved" and num_model_chunks != 1:
        raise ValueError(f"schedule {schedule!r} runs one model chunk per rank; virtual "
                         f"pipeline stages need the 'interleaved' schedule")
    if schedule == "interleaved":
        orders = interleaved_orders(num_microbatches, pp, num_model_chunks)
    elif schedule == "1f1b":
        orders = one_f_one_b_orders(num_microbatches, pp)
    else:
        orders = gpipe_orders(num_microbatches, pp, reverse_backward=schedule == "gpipe")
    return orders, [s % pp for s in range(pp * num_model_chunks)]


def build_static_plans(schedule: str, num_microbatches: int, pp_size: int,
                       num_model_chunks: int, microbatch_shapes: Sequence,
                       activation_shapes: Union[Callable, Sequence], recompute: str = "none",
                       dtype: str = "float32", iteration: int = 0, zb_costs=None) -> list[ExecutionPlan]:
    """Validated per-rank plans for a static schedule.

    `activation_shapes` is a callable ``(mb, stage) -> shapes`` or one fixed tuple of shapes
    used for every stage boundary (e.g. ``((s, b, h),)``). `zb_costs`: see `static_orders`.
    """
    if len(microbatch_shapes) != num_microbatches:
        raise ValueError(f"got {len(microbatch_shapes)} micro-batch shapes for "
                         f"{num_microbatches} micro-batches")
    if not callable(activation_shapes):
        fixed = tuple(tuple(s) for s in activation_shapes)
        activation_shapes = lambda mb, stage: fixed  # noqa: E731
    orders, stage_to_rank = static_orders(schedule, num_microbatches, pp_size, num_model_chunks, zb_costs)
    return lower_to_plans(orders, stage_to_rank, microbatch_shapes, activation_shapes,
                          recompute=recompute, dtype=dtype, iteration=iteration, validate=True)


def analytic_bubble(schedule: str, pp: int, num_microbatches: int, t_f: float, t_b: float,
                    num_model_chunks: int = 1) -> float:
    """Ideal iteration time of a static schedule with no communication cost.

    `t_f`, `t_b` are one micro-batch's forward/backward time on one rank (all of its model
    chunks together). GPipe and 1F1B take ``(m + p - 1) (t_f + t_b)``: a bubble of
    ``(p - 1)/m`` of the ideal ``m (t_f + t_b)``; the interleaved schedule divides the bubble
    by the number of chunks v: ``(m + (p - 1)/v) (t_f + t_b)`` (Megatron-LM, Narayanan et al.
    2021).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    v = num_model_chunks if schedule == "interleaved" else 1
    return (num_microbatches + (pp - 1) / v) * (t_f + t_b)
