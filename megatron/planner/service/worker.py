"""What a DynaPipe planner worker process runs for one iteration.

Kept free of torch (numpy and the planner only) so that plan-service workers, started as
processes of their own by a fork server, come up in well under a second. `plan_fn` objects
are `functools.partial`s of `plan_iteration`, pickled to the workers.

With `trace_dir`, the simulated timeline of the first `trace_iters` iterations planned by
this run is written as a Chrome/Perfetto trace, one file per iteration
(``iter_0000012.sim.json``): one process row per (DP group, pipeline rank), compute ops on
thread 0, transfers on thread 1, the activation-memory counter beside them.
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Optional

import numpy as np

from megatron.atomic import write_json

_PLANNERS: dict = {}


def planner_for(config):
    """One planner (and its cost caches) per worker process and config."""
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    key = repr(config)
    planner = _PLANNERS.get(key)
    if planner is None:
        if config.cp_sizes:  # the CP size chosen per micro-batch (megatron/planner/dynapipe/variable_cp.py)
            from megatron.planner.dynapipe.variable_cp import VariableCPPlanner
            planner = _PLANNERS[key] = VariableCPPlanner(config)
        elif config.context_parallel > 1:  # priced as a CP group's rank (megatron/planner/cost/cp_cost.py)
            from megatron.planner.cost.cp_cost import cp_group_planner
            planner = _PLANNERS[key] = cp_group_planner(config)
        else:
            planner = _PLANNERS[key] = DynaPipePlanner(config)
    return planner


def trace_path(trace_dir: str, iteration: int, kind: str = "sim") -> str:
    return os.path.join(trace_dir, f"iter_{iteration:07d}.{kind}.json")


def iteration_trace(plan) -> dict:
    """One Chrome trace for every DP group of an iteration plan (needs the SimResults)."""
    events = []
    for g, group in enumerate(plan.groups):
        if group.result is None:
            raise ValueError(f"iteration {plan.iteration}: group {g} has no simulation result to trace")
        S = len(group.result.orders)
        for ev in group.result.chrome_trace()["traceEvents"]:
            ev = dict(ev)
            ev["pid"] = g * S + ev["pid"]
            if ev.get("ph") == "M":
                ev["args"] = {"name": f"DP group {g} / pipeline rank {ev['pid'] - g * S}"}
            events.append(ev)
    # simulated_ms is the step: the slowest group's pipeline (pipeline_ms, the trace's length) plus
    # the table's calibrated work outside it (planner/calibration.py)
    meta = {"iteration": plan.iteration, "recompute": plan.recompute, "simulated_ms": plan.makespan_ms,
            "pipeline_ms": max(gp.makespan_ms for gp in plan.groups),
            "schedules": [gp.schedule for gp in plan.groups],
            "microbatch_shapes": [[list(map(list, s)) for s in gp.shapes] for gp in plan.groups],
            "padding_efficiency": plan.padding_efficiency}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def strip(plan):
    """Drop what ranks do not need (simulator results, compute orders: large)."""
    for g in plan.groups:
        g.result = None
        g.compute_orders = []
    return plan


def plan_iteration(config, lengths: np.ndarray, bounds: np.ndarray, first_iteration: int, validate_iters: int,
                   iteration: int, trace_dir: Optional[str] = None, trace_iters: int = 0):
    """Plan global batch `iteration` (samples bounds[k]:bounds[k+1], k = iteration - first_iteration)."""
    k = iteration - first_iteration
    if not 0 <= k < len(bounds) - 1:
        raise IndexError(f"iteration {iteration} is outside the laid-out global batches "
                         f"{first_iteration}..{first_iteration + len(bounds) - 2}")
    lo, hi = int(bounds[k]), int(bounds[k + 1])
    validate = validate_iters < 0 or iteration <= validate_iters
    plan = planner_for(config).plan(lengths[lo:hi].tolist(), iteration=iteration, validate=validate)
    if trace_dir and k < trace_iters:
        os.makedirs(trace_dir, exist_ok=True)
        write_json(trace_path(trace_dir, iteration), iteration_trace(plan), end="")
    return strip(plan)


def batch_digest(lengths: np.ndarray, bounds: np.ndarray, first_iteration: int, iteration: int) -> bytes:
    """sha256 of global batch `iteration` as planned: its number, sample range and lengths. The
    worker stamps a plan with it and every rank recomputes it from its own batch
    (megatron/planner/service/service.py), so a plan cannot be run for another batch."""
    k = iteration - first_iteration
    if not 0 <= k < len(bounds) - 1:
        return bytes(32)  # no such batch: matches no plan (plan_iteration refuses it too)
    lo, hi = int(bounds[k]), int(bounds[k + 1])
    body = np.ascontiguousarray(np.asarray(lengths[lo:hi]), dtype="<i8").tobytes()
    return hashlib.sha256(struct.pack("<qqq", iteration, lo, hi) + body).digest()


def check_covers(plan, iteration: int, num_samples: int) -> None:
    """Every sample of the batch exactly once over the plan's groups (packed rows or
    micro-batches): a plan made for another batch does not pass silently."""
    seen = np.zeros(num_samples, dtype=np.int64)
    for g in plan.groups:
        ids = [i for rows in g.rows for r in rows for i in r] if g.rows is not None else \
            [i for k, mb in enumerate(g.microbatches) for i in mb
             if g.cp is None or g.cp[k][1] == 0]  # variable CP: a sub-group's first rank counts it
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_samples):
            raise ValueError(f"iteration {iteration}: the plan names sample {int(ids.max())} of a batch of "
                             f"{num_samples}: it was made for another batch")
        np.add.at(seen, ids, 1)
    bad = np.flatnonzero(seen != 1)
    if bad.size:
        raise ValueError(f"iteration {iteration}: the plan uses sample {int(bad[0])} of its batch "
                         f"{int(seen[bad[0]])} times (expected once): it was made for another batch")
