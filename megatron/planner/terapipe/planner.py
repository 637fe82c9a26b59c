"""TeraPipe as a planner: the fixed global batches of the Megatron baseline (or a multi-task
source's micro-batches) cut into token slices, chosen per micro-batch shape by --terapipe-slices
or by the DP over the slice latency model (`megatron.planner.terapipe.latency`)."""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional

import numpy as np

from megatron.pipeline.validator import validate_plans
from megatron.planner.passes import plan_passes
from megatron.planner.terapipe.lowering import (GRID, build_terapipe_plans, parse_slices, plan_slices,
                                                slice_memory_mb, slice_times, uniform_slices)


def pipelined_ms(times, pp: int, chunks: int = 1) -> float:
    """Units of per-rank times `times` run back to back through `pp` stages (GPipe order):
    sum t_i + (pp - 1) / chunks * max t_i. The step adds the calibrated work outside the
    pipeline (planner/calibration.py)."""
    return sum(times) + (pp - 1) / chunks * max(times)


class TeraPipePlanner:
    """`plans(iteration, microbatch_shapes)` like `FixedBatchPlanner`; slicings from
    --terapipe-slices (fixed) or the DP over the latency model (auto), cached per shape."""

    def __init__(self, cfg, pp_size: int, latency=None, stage_layouts=(), plan_pass=None):
        self.cfg, self.pp = cfg, pp_size
        self.latency = latency
        self.fixed = parse_slices(cfg.terapipe.slices, cfg.model.seq_length)
        m = cfg.model
        vpp = cfg.parallel.num_layers_per_virtual_pipeline_stage
        self.chunks = 1 if vpp is None else m.num_layers // pp_size // vpp
        self.layers_per_stage = -(-m.num_layers // pp_size)
        self.tp = cfg.parallel.tensor_model_parallel_size
        # --sequence-parallel: each slice is split over the TP ranks, so slice lengths are
        # multiples of TP (the DP's grid is a common multiple of 8 tokens and every stage's TP).
        # With stage layouts the plans carry whole slices and `plan_pass` cuts each stage's
        # tokens at its own TP (planner/hetero.py), so they are not cut here as well.
        self.seq_split = self.tp if m.sequence_parallel and not stage_layouts else 1
        tps = [tp for tp, _ in stage_layouts] or [self.tp]
        self.grid = math.lcm(GRID, *tps) if m.sequence_parallel else GRID
        # Stages with their own (TP, DP) sizes (--aceso-config): the slicing is priced on the
        # slowest stage, each on its rows and layers; `plan_pass` lowers the plans onto them.
        layers = cfg.parallel.pipeline_stage_layers or [self.layers_per_stage] * pp_size
        self.stages = [(tp, dp, n) for (tp, dp), n in zip(stage_layouts, layers)]
        # the run's plan passes (compressed-gradient marks, stage-layout split), in their order
        self.plan_pass = plan_passes(cfg, stage_layouts) if plan_pass is None else plan_pass
        self._slicings: dict = {}
        self._plans: dict = {}
        self.info: dict = {}

    def stage_ms(self, b, l, c) -> float:
        if not self.stages:
            return self.latency.stage_ms(b, l, c, self.layers_per_stage)
        return functools.reduce(np.maximum, [self.latency.stage_ms(b // dp, l, c, n) for _, dp, n in self.stages])

    def fixed_slices(self, s: int) -> list:
        """--terapipe-slices N|l1,l2,... for a sequence of s tokens (multi-task data pads each
        micro-batch to its own length): N uniform slices (at most as many as the sequence has
        grid cells, so that under --sequence-parallel every slice stays a multiple of TP), or
        the given boundaries that fall inside the sequence."""
        if s == self.cfg.model.seq_length:
            return list(self.fixed)
        spec = self.cfg.terapipe.slices.strip()
        if "," not in spec:
            cells = s // self.grid if s % self.grid == 0 else s
            return uniform_slices(s, max(1, min(int(spec), cells)), self.grid)
        cuts = [c for c in np.cumsum(self.fixed)[:-1].tolist() if c < s]
        return np.diff([0] + cuts + [s]).tolist()

    def slicing(self, b: int, s: int) -> tuple:
        key = (b, s)
        if key not in self._slicings:
            t0 = time.perf_counter()
            if self.fixed is not None:
                slices = self.fixed_slices(s)
            elif self.latency is None:
                slices = [s]
            else:
                m = self.cfg.model
                stages = self.stages or [(self.tp, 1, self.layers_per_stage)]

                def mem_ok(sl):
                    return all(slice_memory_mb(sl, b // dp, n, m.hidden_size, m.query_groups * m.kv_channels // tp,
                                               m.num_attention_heads // tp, recompute=self.cfg.training.recompute_level)
                               <= self.cfg.terapipe.memory_limit_mb for tp, dp, n in stages)
                # m micro-batches run back to back: sum over all units + (K-1) max = m * score
                # of one sequence with the effective stage count 1 + (K-1)/m (see plan_batch).
                # Virtual stages (chunks per rank) shrink the fill/drain to (K-1)/chunks of a
                # rank's per-unit time, as Megatron's interleaved schedule does.
                k_eff = 1 + (self.pp - 1) / (max(1, self.cfg.num_microbatches) * self.chunks)
                # exact up to 1024 tokens, caps 0.1 % apart beyond (terapipe.default_cap_tolerance);
                # once per shape: the slicings are cached
                slices = plan_slices(s, k_eff, lambda l, c: self.stage_ms(b, l, c), grid=self.grid, mem_ok=mem_ok,
                                     vectorized=True).slices
            self._slicings[key] = (slices, (time.perf_counter() - t0) * 1e3)
        return self._slicings[key]

    def predicted_ms(self, microbatch_shapes) -> Optional[float]:
        """sum t_i + (K - 1) / chunks * max t_i over all units (they run back to back, GPipe
        order; t_i is a rank's time for unit i over all its virtual stages)."""
        if self.latency is None:
            return None
        times = [t for (b, s), in microbatch_shapes for t in slice_times(self.stage_ms, b, self.slicing(b, s)[0])]
        return pipelined_ms(times, self.pp, self.chunks) + self.latency.calibration.step_overhead_ms

    def plans(self, iteration: int, microbatch_shapes) -> list:
        shapes = tuple(tuple(tuple(x) for x in s) for s in microbatch_shapes)
        t0 = time.perf_counter()
        new = [key for key in {s[0] for s in shapes} if key not in self._slicings]
        slicings = [self.slicing(b, s)[0] for (b, s), in shapes]
        if shapes not in self._plans:
            plans = build_terapipe_plans(slicings, shapes, self.pp, self.cfg.model.hidden_size,
                                         dtype=self.cfg.training.params_dtype_name,
                                         recompute=self.cfg.training.recompute_level,
                                         seq_split=self.seq_split, num_model_chunks=self.chunks)
            # --inter-grad-comp marks each slice's gradient message (its LEP state is keyed by
            # the slice's token offset, compression.pipeline.error_key); stages with their own
            # TP/DP get the plans lowered onto their ranks.
            if self.plan_pass is not None:
                plans = self.plan_pass(plans)
                validate_plans(plans)
            self._plans = {shapes: plans}
        self.info = {"planner": "terapipe", "num_microbatches": len(shapes),
                     "microbatch_shapes": [s[0] for s in shapes],
                     "slices": slicings[0] if all(s == slicings[0] for s in slicings) else slicings,
                     # wall time of this call: the DP and plan building run once per new shape
                     "planning_ms": (time.perf_counter() - t0) * 1e3,
                     "dp_ms_new_shapes": sum(self._slicings[key][1] for key in new)}
        pred = self.predicted_ms(shapes)
        if pred is not None:
            self.info["simulated_ms"] = pred
        return [dataclasses.replace(p, iteration=iteration) for p in self._plans[shapes]]


def terapipe_planner(cfg, ps) -> TeraPipePlanner:
    latency = None
    if cfg.terapipe.cost_model:
        from megatron.planner.terapipe.latency import SliceLatencyModel
        latency = SliceLatencyModel.load(cfg.terapipe.cost_model)
    return TeraPipePlanner(cfg, ps.pp_size, latency, ps.stage_layouts, plan_passes(cfg, ps.stage_layouts))
