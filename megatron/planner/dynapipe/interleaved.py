"""DynaPipe over virtual pipeline stages (`--dynapipe --num-layers-per-virtual-pipeline-stage`).

The model is cut into S = PP * v virtual stages of `num_layers / S` layers, placed
round-robin (stage s on pipeline rank s % PP) as in Megatron's interleaved 1F1B. DynaPipe's
steps stay the same (order samples, cut micro-batches optimally, split over DP groups, search
micro-batch orders, lower), with three changes:

* Costs: per virtual stage from the cost model at layers-per-virtual-stage (the first stage
  embeds, the last runs the head). A micro-batch's bottleneck is the busiest *rank*: the sum
  of its v chunks' forward + backward, since one device runs them one after the other. The
  partition objective's bubble term is ``(PP - 1) / v`` of that (the interleaved schedule
  divides the bubble by v), i.e. `optimal_partition` with ``1 + (PP - 1) / v`` stages.
* Memory: per rank, the device limit less the model states of all of its chunks; a
  micro-batch "fits" when the interleaved warm-up's in-flight forwards on every rank fit
  (``W_r = 2 (PP - r - 1) + (v - 1) PP`` chunk forwards before the first backward, plus
  the one running), each holding at most its largest chunk's activations; where the chosen
  partition's schedules still pass the limit (micro-batches of different sizes in flight
  together), the partition is redone assuming more in flight (`FIT_EXTRA`).
* Schedule: Megatron's interleaved 1F1B generalised to variable micro-batches in a chosen
  order and to any number of them (`interleaved_orders`): micro-batches go in groups of PP
  through chunk 0, 1, ..., v-1 (a remainder joins the last group, whose size G then replaces
  PP in W_r); backwards mirror that with the chunks reversed; rank r runs W_r forwards, then
  alternates, then drains. Candidates are replayed with `replay.replay(..., stage_to_rank)`
  (the rules of `simulate(..., stage_to_rank)`, which serialises a rank's chunks on one compute
  stream and sums their memory); a candidate whose per-rank peak passes the rank's limit is
  dropped. The memory-admitting adaptive schedule and the token-slice / packed-row
  searches of `DynaPipePlanner` schedule one stage per rank, so they are not used here.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from megatron.planner.dynapipe import partitioner as part
from megatron.planner.cost.attention_cost import AttentionCost
from megatron.planner.cost.cost_model import CostModel
from megatron.planner.dynapipe.base import DynaPipeBase, DynaPipeConfig, PlanningError
from megatron.planner.schedule.interleaved_order import interleaved_op_orders, microbatch_groups, warmup_forwards  # noqa: F401 (re-exported)
from megatron.planner.schedule.replay import cost_lists, replay
from megatron.planner.schedule.schedules import ScheduleChoice, search_orders
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, simulate


def interleaved_orders(pp: int, v: int, order: Sequence[int], extra_warmup: int = 0) -> List[List[ComputeOp]]:
    """Per-rank simulator ops of interleaved 1F1B for micro-batches run in `order` (any count):
    `interleaved_order.interleaved_op_orders`. With m a multiple of PP this is exactly
    `megatron.planner.schedule.static.interleaved_orders`."""
    return interleaved_op_orders(pp, v, order, ComputeOp, extra_warmup)


class InterleavedDynaPipePlanner(DynaPipeBase):
    """`DynaPipePlanner` on PP * v virtual stages, v per pipeline rank (GPT)."""

    def __init__(self, config: DynaPipeConfig, cost_model: Optional[CostModel] = None):
        c = config
        if c.model_kind != "gpt":
            raise ValueError("interleaved DynaPipe plans GPT only (T5's encoder/decoder halves are whole ranks)")
        if c.packed_rows or c.token_slices:
            raise ValueError("interleaved DynaPipe plans padded micro-batches: packed rows and token slices "
                             "are searched with one-stage-per-rank schedules")
        self.cfg = c
        self.cm = cost_model or CostModel.load(c.cost_model_path)
        if self.cm.kind != c.model_kind:
            raise ValueError(f"cost model {self.cm.name!r} is for {self.cm.kind!r}, config is {c.model_kind!r}")
        self.PP, self.v = c.pipeline_parallel, c.virtual_stages
        self.S = self.PP * self.v
        n = c.layers_per_stage or c.num_layers // self.S
        if n < 1 or (c.layers_per_stage is None and c.num_layers % self.S):
            raise ValueError(f"{c.num_layers} GPT layers do not split evenly over {self.PP} x {self.v} virtual stages")
        self.layout = [[("encoder", n)] for _ in range(self.S)]
        self.stage_to_rank = [s % self.PP for s in range(self.S)]
        # one TP and DP for every virtual stage (stages with their own sizes are Aceso layouts)
        self.stage_tp, self.stage_dp, self.row_multiple = [c.tensor_parallel] * self.S, [1] * self.S, 1
        self.split = self.enc_end = None
        self.available = self._available_memory()
        self._cache = {}
        self._mb_memo = {}
        self.calibration = self.cm.calibration
        self._scheduled = {}  # id(partition) -> (partition, `_schedule_groups` result without a bound)
        self.attention = AttentionCost(self.cm)
        self.warmup = np.array([warmup_forwards(self.PP, self.v, r) for r in range(self.PP)], float)

    # ---- memory (per rank) -----------------------------------------------------------
    def _available_memory(self) -> np.ndarray:
        c, tp = self.cfg, self.cfg.tensor_parallel
        zero = c.zero_shards or c.data_parallel
        per_param = (c.weight_grad_bytes_per_param + c.optimizer_bytes_per_param / zero) / 2.0
        states = np.zeros(self.PP)
        for s, comps in enumerate(self.layout):
            mb = sum(n * self.cm.param_mb(comp, tp) for comp, n in comps)
            if s == 0 or s == self.S - 1:
                mb += self.cm.param_mb("embedding", tp)
            states[self.stage_to_rank[s]] += mb * per_param
        avail = c.memory_limit_mb - states
        if (avail <= 0).any():
            r = int(np.argmin(avail))
            raise PlanningError(f"model states alone exceed memory_limit_mb={c.memory_limit_mb} on pipeline rank {r}")
        return avail

    def _per_rank(self, a: np.ndarray, how) -> np.ndarray:
        """(S, ...) per virtual stage -> (PP, ...) per rank, reducing a rank's chunks with `how`."""
        return how(a.reshape((self.v, self.PP) + a.shape[1:]), axis=0)

    def _feasible(self, sc: dict, fit) -> np.ndarray:
        """`fit`: "single", or ("1f1b", extra): the warm-up's forwards plus `extra` more in flight."""
        stored, peak = self._per_rank(sc["stored"], np.max), self._per_rank(sc["peak"], np.max)
        inflight = np.zeros(self.PP) if fit == "single" else self.warmup + fit[1]
        shape = (self.PP,) + (1,) * (peak.ndim - 1)
        with np.errstate(invalid="ignore"):
            need = inflight.reshape(shape) * stored + peak
        ok = ((need <= self.available.reshape(shape)) & np.isfinite(sc["fwd"]).all(axis=0)
              & np.isfinite(sc["bwd"]).all(axis=0))
        return ok.all(axis=0)

    def _bottleneck(self, sc: dict) -> np.ndarray:
        return self._per_rank(sc["fwd"] + sc["bwd"], np.sum).max(axis=0)

    # ---- partition and schedules -----------------------------------------------------
    # Extra in-flight forwards the "1f1b" fit assumes, tried in turn until the partition's quick
    # schedule fits: micro-batches of different sizes in flight together (and a last group
    # larger than PP) can pass the per-micro-batch estimate; without this a recompute level
    # whose estimate fits but whose schedules do not would be dropped (there is no
    # memory-admitting interleaved schedule to fall back on).
    FIT_EXTRA = (0, 1, 2, 3, 4, 6, 8, 12, 16)

    def _partitions(self, rc, fit, orders, enc_all, dec_all, errors):
        """The base planner's hook: one candidate, the partition whose schedules fit."""
        got = self._best_partition(rc, fit, orders, enc_all, dec_all, errors)
        return [got] if got is not None else []

    def _best_partition(self, rc, fit, orders, enc_all, dec_all, errors):
        if fit != "1f1b":
            return self._partition(rc, "single", orders, enc_all, errors)
        last = None  # a partition whose schedules do not fit: `plan` then finds no schedule for it
        for extra in self.FIT_EXTRA:
            got = self._partition(rc, ("1f1b", extra), orders, enc_all, errors)
            if got is None:  # assuming more in flight only makes it worse
                return last
            sched = self._schedule_groups(rc, got[0], got[1], enc_all, None, np.inf)
            if sched is not None:
                if len(self._scheduled) > 16:
                    self._scheduled.clear()
                self._scheduled[id(got[1])] = (got[1], sched)  # `plan` asks again with a bound
                return got
            last = got
        return last

    def _partition(self, rc, fit, orders, enc_all, errors):
        best = None
        for order in orders:
            T = self.segment_times(rc, fit, enc_all[order], None)
            try:  # bubble (PP - 1) / v of a rank's time per micro-batch
                p = part.optimal_partition(T, 1.0 + (self.PP - 1) / self.v, self.cfg.data_parallel)
            except part.PartitionError as e:
                errors.append(f"recompute={rc}, fit={fit if fit == 'single' else f'1f1b+{fit[1]}'}: {e}")
                continue
            if best is None or p.objective < best[1].objective:
                best = (order, p)
        return best

    def search(self, costs: PipelineCosts, orders: List[List[int]], bound: float) -> Optional[ScheduleChoice]:
        """Fastest interleaved schedule over `orders` whose per-rank peak fits and beats `bound`."""
        lists, limit = cost_lists(costs), self.available.tolist()
        best = None  # (makespan, order, ops)
        for order in orders:
            # Every forward first is the safety net should the steady state deadlock (the
            # groups of `microbatch_groups` never did for PP <= 8, v <= 4, m <= 41).
            for extra in (0, 2 * len(order) * self.v):
                ops = interleaved_orders(self.PP, self.v, order, extra)
                try:
                    got = replay(lists, ops, self.stage_to_rank, min(bound, best[0] if best else np.inf), limit)
                except SimulationError:
                    continue
                if got is not None:
                    best = (got[0], list(order), ops)
                break
        if best is None:
            return None
        return ScheduleChoice("interleaved", best[1], best[2], simulate(costs, best[2], self.stage_to_rank))

    def _schedule_groups(self, rc, order, p, enc_all, dec_all, bound):
        known = self._scheduled.get(id(p))
        if known is not None and known[0] is p:  # the unbounded search's best; a bound only prunes
            return known[1] if known[1][0] < bound else None
        return super()._schedule_groups(rc, order, p, enc_all, dec_all, bound)

    def _quick_search(self, sub, bound):
        # The cheap orders (longest / shortest / slowest first, long-short alternating), then
        # the cluster orders: with every micro-batch in flight v times over, the order
        # decides whether the peak fits at all, and there is no memory-admitting fallback.
        quick = search_orders(sub, 4, 0, self.cfg.exhaustive_orders_up_to)
        ch = self.search(sub, quick, bound)
        if ch is None and self.cfg.order_clusters >= 2:
            more = search_orders(sub, 4, self.cfg.order_clusters, self.cfg.exhaustive_orders_up_to)
            ch = self.search(sub, [o for o in more if o not in quick], bound)
        return ch

    def _refine_group(self, sub: PipelineCosts, ch: ScheduleChoice) -> Optional[ScheduleChoice]:
        """Every order of `order_clusters` clusters of micro-batches (the base loops the groups)."""
        cands = search_orders(sub, self.cfg.max_orders, self.cfg.order_clusters, self.cfg.exhaustive_orders_up_to)
        return self.search(sub, [o for o in cands if o != ch.order], ch.result.makespan)
