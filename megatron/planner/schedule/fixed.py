"""Megatron's static schedules as a planner: plans for fixed-shape micro-batches.

The planner protocol every planner follows: `plans(iteration, microbatch_shapes)` returns all
pipeline ranks' `ExecutionPlan`s of one iteration (one data-parallel group), built once per
distinct shape set, passed through the run's plan passes (`megatron.planner.passes`) and
validated."""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence

from megatron.config.schedules import SPLIT_SCHEDULES as ZB_SCHEDULES, V_SCHEDULES
from megatron.pipeline.validator import validate_plans
from megatron.planner.schedule.static import build_static_plans


class FixedBatchPlanner:
    """Megatron's static schedules (1F1B / GPipe / interleaved) for fixed-shape micro-batches.

    Plans depend only on the micro-batch shapes, so they are built (and validated) once per
    distinct shape set and reused. The cache is bounded: the fixed-micro-batch baseline on
    multi-task data meets a new shape set almost every iteration."""

    CACHE_SIZE = 64

    def __init__(self, schedule: str, pp_size: int, num_model_chunks: int, activation_shapes_fn: Callable,
                 recompute: str, dtype: str, plan_pass: Optional[Callable[[list], list]] = None,
                 zb_costs: Optional[Callable[[int], object]] = None):
        self.schedule = "interleaved" if num_model_chunks > 1 and schedule not in V_SCHEDULES else schedule
        self.pp_size, self.num_model_chunks = pp_size, num_model_chunks
        self.activation_shapes_fn, self.recompute, self.dtype = activation_shapes_fn, recompute, dtype
        self._cache: "collections.OrderedDict[tuple, list]" = collections.OrderedDict()
        # Rewrites all ranks' plans after lowering, e.g. marking compressed gradient messages.
        self.plan_pass = plan_pass
        # m -> per-stage costs that clock a zero-bubble schedule's greedy (`zb_costs.run_stage_costs`):
        # on unit costs its V orders miss that the last stage runs the output layer.
        self.zb_costs = zb_costs if schedule in ZB_SCHEDULES else None

    def plans(self, iteration: int, microbatch_shapes: Sequence[tuple]) -> list:
        key = tuple(microbatch_shapes)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            if len(self._cache) >= self.CACHE_SIZE:
                self._cache.popitem(last=False)
            plans = build_static_plans(
                self.schedule, len(microbatch_shapes), self.pp_size, self.num_model_chunks,
                list(microbatch_shapes), self.activation_shapes_fn(list(microbatch_shapes)),
                recompute=self.recompute, dtype=self.dtype, iteration=iteration,
                zb_costs=None if self.zb_costs is None else self.zb_costs(len(microbatch_shapes)))
            if self.plan_pass is not None:
                plans = self.plan_pass(plans)
                validate_plans(plans)
            self._cache[key] = plans
        return [dataclasses.replace(p, iteration=iteration) for p in self._cache[key]]
