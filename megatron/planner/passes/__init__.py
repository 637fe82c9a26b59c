"""The plan passes of a run, composed in one place for every model and every planner.

A plan pass rewrites all pipeline ranks' `ExecutionPlan`s of one iteration after lowering.
Order matters and is fixed here: compressed-gradient marks first (a message is named by its
micro-batch and sending stage, `passes.compression`), then the stage-layout split
(`passes.layout`: each marked message is cut into the row pieces of stages with their own
TP/DP, and every piece keeps the mark). Builders and planners call `plan_passes`; none
composes passes by hand, so no system's attribute can be dropped by one builder.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from megatron.planner.passes.compression import grad_compression_pass
from megatron.planner.passes.layout import layout_pass


class PlanPasses:
    """An ordered list of named passes, applied as one function."""

    def __init__(self, passes: Sequence[Tuple[str, Callable[[list], list]]]):
        self.passes = list(passes)

    @property
    def names(self) -> List[str]:
        return [n for n, _ in self.passes]

    def __call__(self, plans: list) -> list:
        for _, fn in self.passes:
            plans = fn(plans)
        return plans

    def __bool__(self) -> bool:
        return bool(self.passes)


def plan_passes(cfg, stage_layouts=(), presplit: bool = False) -> Optional[PlanPasses]:
    """The passes this run's flags ask for, in order; None when there are none.

    `stage_layouts`: the per-stage (TP, DP) sizes of an Aceso layout (`ps.stage_layouts`), empty
    for a uniform layout. `presplit`: the planner already lowered its plans onto the layout
    (DynaPipe prices and splits each stage's rows itself), so only the marks remain to apply."""
    passes = []
    mark = grad_compression_pass(cfg)
    if mark is not None:
        passes.append(("compressed-grads", mark))
    if stage_layouts and not presplit:
        passes.append(("stage-layout", layout_pass(stage_layouts, cfg.model.sequence_parallel)))
    return PlanPasses(passes) if passes else None
