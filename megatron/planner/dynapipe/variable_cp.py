"""DynaPipe with the CP size chosen per micro-batch (`--dynapipe-cp-sizes`).

A static CP group of N ranks (`--context-parallel-size N`) runs every micro-batch on all N
ranks; a short micro-batch then pays the K/V exchange and N-way cuts of tiny sequences for
nothing. Here each micro-batch gets a size c from the allowed sizes (each divides N) and a
sub-group: the CP group of each DP rank is cut into N/c groups of c consecutive CP indices
(ParallelState.cp_subgroups, nested: CP 1 and CP 2 inside CP 4), so short micro-batches run at
CP 1 on the group's ranks as extra data parallelism and long ones on the whole group.

Pricing: each size c has its planner (megatron/planner/cost/cp_cost.py at c; the plain table at
c = 1), whose `stage_costs` give a micro-batch's forward + backward time and activation peak on
a rank of a c-group. Micro-batches come from DynaPipe's own partitions (the static CP-N plan's,
and a CP-1 plan's over DP x N ranks when one fits); they are placed longest first on the
(size, sub-group) that finishes them earliest (a sub-group starts when its busiest rank is free),
sizes whose peak exceeds the memory limit excluded. The plan with the shortest makespan wins,
the static one (every micro-batch at N) among the candidates, so choosing never predicts slower.

Plan format: one `GroupPlan` per rank of DP x CP ("lane", index dp_rank * N + cp_rank, the
ParallelState.grad_rank order), holding the micro-batches that rank runs in run order, their
whole (unsplit) shapes, and `cp` = [size, index in the sub-group] per micro-batch; its plan loads
S/c tokens. Every rank runs its micro-batches in the order of their planned start, which is one
total order over all lanes, so the sub-groups' collectives cannot deadlock. With PP > 1 every stage
uses the same split (peers stay CP index i at stage s to i at s+1) and a lane runs all forwards,
then all backwards, in that order (1F1B's warm-ups would order a sub-group's collectives
differently on its ranks); it is priced with GPipe's memory (docs/context_parallel.md).
"""
from __future__ import annotations

import dataclasses
import time
from typing import List

import numpy as np

from megatron.planner.dynapipe.base import DynaPipeIterationPlan, GroupPlan, PlanningError


def _size_planner(cfg, c: int):
    """The planner that prices a micro-batch on one rank of a CP group of c (its `stage_costs`)."""
    from megatron.planner.cost.cp_cost import cp_group_planner
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    n = cfg.context_parallel
    sub = dataclasses.replace(cfg, context_parallel=c, cp_sizes=(), data_parallel=cfg.data_parallel * n // c,
                              bandwidth_gbps=cfg.bandwidth_gbps / n * c)
    return cp_group_planner(sub) if c > 1 else DynaPipePlanner(sub)


class VariableCPPlanner:
    """`plan(lengths)` -> a DynaPipeIterationPlan of DP x N lanes (see the module docstring)."""

    def __init__(self, cfg):
        if cfg.model_kind != "gpt" or cfg.virtual_stages > 1 or cfg.stage_parallel or cfg.token_slices:
            raise ValueError("the CP size per micro-batch (cp_sizes) is built for GPT, one stage per rank, one "
                             "TP x DP layout and no token slices")
        n = cfg.context_parallel
        if n < 2 or n not in cfg.cp_sizes or any(n % c for c in cfg.cp_sizes):
            raise ValueError(f"cp_sizes {cfg.cp_sizes}: each must divide context_parallel {n}, which is one of them")
        self.cfg, self.n, self.sizes = cfg, n, sorted(int(c) for c in cfg.cp_sizes)
        self.priced = {c: _size_planner(cfg, c) for c in self.sizes}
        self.static = self.priced[n]
        self.fine = self.priced[1] if 1 in self.priced else None  # micro-batches sized for one rank

    # -- pricing --------------------------------------------------------------------------
    def costs(self, rc: str, mbs: List[List[int]], lens: np.ndarray):
        """Per size c: (time ms of one micro-batch on a c-group's rank, fits in memory, activation
        peak MB), arrays."""
        b = np.array([len(m) for m in mbs], float)
        s = np.array([int(lens[m].max()) for m in mbs], float)
        out = {}
        for c, pl in self.priced.items():
            sc = pl.stage_costs(rc, b, s)
            per_stage = sc["fwd"] + sc["bwd"]
            # PP 1: the micro-batch's time. PP > 1 (lanes run all forwards, then all backwards):
            # its bottleneck stage's time in the steady state, and the rest of the pipeline's
            # latency (`fill`) once per lane
            t = per_stage.max(axis=0)
            fill = per_stage.sum(axis=0) - t
            fits = (sc["peak"] <= pl.available[:, None]).all(axis=0) & np.isfinite(t)
            out[c] = (t, fits, sc["peak"].max(axis=0), sc["stored"], sc["transient"], fill, pl.available)
        return out, s.astype(int)

    def assign(self, costs, size_of) -> tuple:
        """Micro-batch i runs at size size_of[i]: longest first onto the sub-group of that size
        that finishes it earliest (a sub-group starts when its busiest rank is free). Returns
        (makespan, placements [(mb, c, dp, k, start)]); inf when a size does not fit."""
        dp, n = self.cfg.data_parallel, self.n
        loads = np.zeros((dp, n))
        t = np.array([costs[c][0][i] for i, c in enumerate(size_of)])
        if not all(costs[c][1][i] for i, c in enumerate(size_of)):
            return np.inf, []
        pp = self.cfg.pipeline_parallel
        kept = np.zeros((dp, n, pp))  # PP > 1: a lane keeps every micro-batch's stored activations
        placed, fill = [], 0.0
        for i in np.argsort(-t, kind="stable"):
            c = size_of[i]
            _, _, _, stored, transient, fl, avail = costs[c]
            options = []
            for d in range(dp):
                for k in range(n // c):
                    lanes = slice(k * c, (k + 1) * c)
                    if pp > 1 and (kept[d, lanes] + stored[:, i] + transient[:, i] > avail).any():
                        continue
                    options.append((loads[d, lanes].max(), d, k))
            if not options:
                return np.inf, []
            start, d, k = min(options)
            loads[d, k * c:(k + 1) * c] = start + t[i]
            if pp > 1:
                kept[d, k * c:(k + 1) * c] += stored[:, i]
                fill = max(fill, float(fl[i]))
            placed.append((int(i), int(c), d, k, float(start)))
        return float(loads.max()) + fill, placed

    def choices(self, costs, seqs):
        """Size vectors to price: micro-batches ordered longest first, the first k1 at the
        largest size, the next k2 at the next size, ..., the rest at the smallest (short ones at
        CP 1, long ones at CP N); the split points (all of them up to 40 micro-batches), for up
        to three sizes (else the largest and the smallest only)."""
        order = np.argsort(-np.asarray(seqs), kind="stable")
        m = len(order)
        sizes = sorted(self.sizes, reverse=True)
        if len(sizes) > 3:
            sizes = [sizes[0], sizes[-1]]
        # split points: every one up to 40 micro-batches, then an even grid of ~40 (planning time
        # grows as points^2 x micro-batches with three sizes)
        points = sorted(set(range(0, m + 1, max(1, -(-m // 40)))) | {m})
        cuts = [()] if len(sizes) == 1 else [(k,) for k in points] if len(sizes) == 2 else \
            [(k1, k2) for k1 in points for k2 in points if k2 >= k1]
        for cut in cuts:
            size_of = np.empty(m, dtype=np.int64)
            bounds = (0,) + cut + (m,)
            for j, c in enumerate(sizes):
                size_of[order[bounds[j]:bounds[j + 1]]] = c
            yield size_of

    # -- planning -------------------------------------------------------------------------
    def plan(self, lengths, iteration: int = 0, validate: bool = True) -> DynaPipeIterationPlan:
        t0 = time.perf_counter()
        lens = self.static._pad(np.asarray(lengths, dtype=np.int64).reshape(-1))
        partitions = []
        for pl in (self.static, self.fine):
            if pl is None:
                continue
            try:
                p = self._partition(pl, lengths, iteration)
            except PlanningError:
                continue
            partitions.append((p.recompute, [mb for g in p.groups for mb in g.microbatches]))
        if not partitions:
            raise PlanningError(f"iteration {iteration}: no CP size fits the batch in memory")
        best = None
        for rc, mbs in partitions:
            costs, seqs = self.costs(rc, mbs, lens)
            for size_of in self.choices(costs, seqs):  # every micro-batch at N (static) among them
                makespan, placed = self.assign(costs, size_of)
                if np.isfinite(makespan) and self._every_lane_busy(placed) and (best is None or makespan < best[0]):
                    best = (makespan, rc, mbs, seqs, placed, costs)
        if best is None:
            raise PlanningError(f"iteration {iteration}: no CP size fits the batch in memory")
        planning_ms = (time.perf_counter() - t0) * 1e3
        groups = self._lanes(best, iteration, validate)
        real = int(np.asarray(lengths, dtype=np.int64).sum())
        computed = sum(len(m) * int(s) for m, s in zip(best[2], best[3]))
        return DynaPipeIterationPlan(
            iteration=iteration, recompute=best[1], groups=groups, makespan_ms=self.static.iteration_ms(best[0]),
            padding_efficiency=real / float(computed), planning_ms=planning_ms,
            lowering_ms=(time.perf_counter() - t0) * 1e3 - planning_ms, memory_fallback=False)

    @staticmethod
    def _partition(pl, lengths, iteration):
        saved = pl.cfg.emit_plans
        pl.cfg.emit_plans = False  # only its micro-batches are used
        try:
            return pl.plan(lengths, iteration, validate=False)
        finally:
            pl.cfg.emit_plans = saved

    def _every_lane_busy(self, placed) -> bool:
        """A rank with no micro-batch would reach the gradient reduction with nothing run: not planned."""
        busy = np.zeros((self.cfg.data_parallel, self.n), bool)
        for _, c, d, k, _ in placed:
            busy[d, k * c:(k + 1) * c] = True
        return bool(busy.all())

    def _lanes(self, best, iteration, validate) -> List[GroupPlan]:
        from megatron.pipeline.lowering import ComputeOp, lower_to_plans
        makespan, rc, mbs, seqs, placed, costs = best
        n, h = self.n, self.cfg.hidden_size
        per_lane = {(d, i): [] for d in range(self.cfg.data_parallel) for i in range(n)}
        for order, (mb, c, d, k, start) in enumerate(sorted(placed, key=lambda x: (x[4], x[0]))):
            for j in range(c):  # one total order (planned start) on every lane: no deadlock
                per_lane[(d, k * c + j)].append((mb, c, j))
        groups = []
        for (d, i), items in sorted(per_lane.items()):
            shapes = [((len(mbs[mb]), int(seqs[mb])),) for mb, _, _ in items]
            loads = [((b, s // c),) for ((b, s),), (_, c, _) in zip(shapes, items)]
            pp = self.cfg.pipeline_parallel
            if pp == 1:
                orders = [[ComputeOp(kind, k, 0) for k in range(len(items)) for kind in ("F", "B")]]
            else:  # all forwards, then all backwards, both in the one global order: every rank's
                # ops follow the key (F, order, stage) < (B, order, -stage), so the sub-groups'
                # collectives meet in the same order on all their ranks (1F1B's warm-up would differ)
                orders = [[ComputeOp("F", k, st) for k in range(len(items))]
                          + [ComputeOp("B", k, st) for k in range(len(items))] for st in range(pp)]
            plans = []
            if self.cfg.emit_plans:
                plans = lower_to_plans(orders, list(range(pp)), loads,
                                       lambda mb, stage: ((loads[mb][0][1], loads[mb][0][0], h),),
                                       recompute=rc, dtype=self.cfg.dtype, iteration=iteration, validate=validate)
            busy = sum(costs[c][0][mb] for mb, c, _ in items)
            if pp == 1:  # one micro-batch in flight
                peak = [max(float(costs[c][2][mb]) for mb, c, _ in items)]
            else:  # every micro-batch's stored activations, plus the largest transient
                peak = [float(sum(costs[c][3][st, mb] for mb, c, _ in items)
                              + max(costs[c][4][st, mb] for mb, c, _ in items)) for st in range(pp)]
            groups.append(GroupPlan([[int(x) for x in mbs[mb]] for mb, _, _ in items], shapes,
                                    "1f1b" if pp == 1 else "gpipe", float(busy),
                                    peak, plans, orders, None, cp=[[int(c), int(j)] for _, c, j in items]))
        return groups
