"""DynaPipe's micro-batches cut into TeraPipe token slices (GPT; `--dynapipe --terapipe`).

A micro-batch of b sequences padded to L tokens may run as k slices [c_i, c_i + l_i): per
stage its forward F(m) becomes F(m, 1..k) and its backward B(m) becomes B(m, k..1), so stage
s + 1 works on slice 1 while stage s runs slice 2 and a single micro-batch already fills the
pipeline. What that buys: DynaPipe alone needs about S micro-batches in flight to fill S
stages, which long sequences cannot afford in memory (GPT 8192: few, small micro-batches,
and the memory-admitting schedule leaves bubbles); with slices fewer micro-batches in flight
keep the stages busy.

Costs of a slice of l tokens after c context tokens (`slice_costs`), per stage: the cost
table's dense micro-batch (b, l) (token-wise work and per-kernel efficiency at that shape)
plus the attention of its l queries to the c earlier keys, priced with the table's fitted s^2
coefficient (`megatron.planner.cost.attention_cost`: causal attention of a row of L tokens costs
beta * L^2, so the slice's extra is beta * ((c + l)^2 - c^2 - l^2) = beta * 2lc per row),
for time and for the attention memory the slice keeps. Each slice also keeps, from its
forward to its backward, its keys/values in the sequence's cache and its concatenated
context keys/values: 2 * (h / tp) * (c + 2l) values per row and layer (`kv_cache_mb`, the
accounting of `terapipe.slice_memory_mb`). The simulator then runs units (one per slice)
with these costs, so memory peaks count every slice in flight.

Search (`plan_sliced`): candidate partitions are (a) DynaPipe's own partitions of every
recompute level (post-pass), (b) partitions cut with sliced costs (`_SlicedCostPlanner`: a
micro-batch costs the sum of its slices and only has to fit once in flight, which admits
micro-batches no unsliced schedule can hold); per partition and DP group, slicings (uniform
N per micro-batch, N in `AUTO_SLICES`, or TeraPipe's DP per micro-batch shape) x schedules
(1F1B with at most f micro-batches in flight, f = 1..S, and the memory-admitting adaptive
schedule, expanded to slices) are simulated, the fastest that fits memory wins. With
`--terapipe-slices auto` an unsliced plan is kept when it is faster; with N every
micro-batch runs in N uniform slices on the slicing grid. Full recompute is never sliced
(it would replay a layer and write its slice's keys/values twice, see terapipe_options).

--sequence-parallel (`_grid`, `_seq_split`): each slice is split along its tokens over the TP
ranks, so slice boundaries lie on a grid of lcm(8, TP) tokens (the trainer pads lengths to
that multiple, `supervised_training.pad_multiple`) and the plans are lowered by TeraPipe's
`lower_sliced` with `seq_split = TP` (stages exchange [l / TP, b, h]), as `build_terapipe_plans`
does. Memory: a slice's dense part is `stage_costs` at (b, l), which applies DynaPipe's
`sp_memory_factor` at the slice's length; the attention to the context and the K/V cache are
not scaled, since both live after the all-gather, split by heads (h / TP) with or without SP.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional

import numpy as np

from megatron.planner.dynapipe import partitioner as part
from megatron.planner.schedule.orders import one_f_one_b
from megatron.planner.schedule.replay import cost_lists, replay
from megatron.planner.schedule.schedules import _adaptive, ScheduleInfeasible, lower_bound
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, simulate
from megatron.planner.terapipe.lowering import lower_sliced, plan_slices
from megatron.config.terapipe import SLICE_GRID, uniform_slices
from megatron.config.terapipe import slice_offsets as offsets

AUTO_SLICES = (1, 2, 4, 8, 16)
COST_SLICE_TOKENS = 1024  # slice length the sliced partition costs a long micro-batch with
MIN_SLICE_TOKENS = 16     # the smallest slice the tables are measured at
SLICED_COST_PARTITIONS = True  # also slice partitions cut with sliced costs (False: the post-pass alone)


# ---------------------------------------------------------------------------- costs
def _layers_per_stage(planner) -> List[int]:
    return [sum(n for _, n in comps) for comps in planner.layout]


def _quad_coef(planner, rc: str, quantity: str) -> float:
    sp = planner.attention.split(planner.cfg.tensor_parallel, rc, "encoder", quantity)
    return 0.0 if sp is None else float(sp.coef.get("quad", 0.0))


def kv_cache_mb(planner, b, l, c) -> np.ndarray:
    """Per layer: keys/values a slice keeps from its forward to its backward (its own rows in
    the sequence's cache + its concatenated context), MB."""
    h = planner.cfg.hidden_size / planner.cfg.tensor_parallel
    return 2.0 * h * np.asarray(b, float) * (np.asarray(c, float) + 2.0 * np.asarray(l, float)) \
        * planner.cfg.activation_bytes / 1e6


def slice_costs(planner, rc: str, b, l, c) -> dict:
    """Per-stage (S, *shape) fwd, bwd, stored, transient, comm of slices of `l` tokens after
    `c` context tokens, `b` rows (broadcast arrays)."""
    b, l, c = np.broadcast_arrays(np.asarray(b, float), np.asarray(l, float), np.asarray(c, float))
    sc = planner.stage_costs(rc, b, l)
    n = np.asarray(_layers_per_stage(planner), float).reshape((-1,) + (1,) * b.ndim)
    cross = b * 2.0 * l * c  # extra "squared length" of attending to the context
    out = {"comm": np.array(sc["comm"])}
    scale = planner.calibration.compute_scale  # stage_costs applied it to the rest of the slice
    out["fwd"] = sc["fwd"] + scale * n * _quad_coef(planner, rc, "forward_ms") * cross
    out["bwd"] = sc["bwd"] + scale * n * _quad_coef(planner, rc, "backward_ms") * cross
    d_stored = _quad_coef(planner, rc, "stored_mb") * cross
    d_peak = _quad_coef(planner, rc, "peak_mb") * cross
    out["stored"] = sc["stored"] + n * (d_stored + kv_cache_mb(planner, b, l, c))
    out["transient"] = sc["transient"] + np.maximum(d_peak - d_stored, 0.0)
    return out


def _seq_split(planner) -> int:
    """How many pieces a slice's stage messages are cut into along the tokens: the TP size
    under --sequence-parallel (one TP for every stage), else 1."""
    c = planner.cfg
    return c.tensor_parallel if c.sequence_parallel and not c.stage_parallel else 1


def _grid(planner) -> int:
    """Slice boundaries: multiples of 8 tokens and, under --sequence-parallel, of every TP
    size (each TP rank holds an equal piece of every slice)."""
    c = planner.cfg
    if not c.sequence_parallel:
        return SLICE_GRID
    return math.lcm(SLICE_GRID, *([t for t, _ in c.stage_parallel] if c.stage_parallel else [c.tensor_parallel]))


class _SlicedCostPlanner:
    """The planner's partition machinery with a micro-batch priced as the sum of its slices
    (`COST_SLICE_TOKENS` each) and its memory as all slices in flight (plus the largest
    working set): lengths past the cost table's end become plannable, and the "single" fit
    admits what a sliced schedule with one micro-batch in flight can run."""

    def __init__(self, base):
        self.base = base
        self._cache = {}

    def __getattr__(self, name):  # everything but the costs comes from the real planner
        if name == "base":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def stage_costs(self, rc, mbs, enc, dec=None, packed=None):
        b, L = np.broadcast_arrays(np.asarray(mbs, float), np.asarray(enc, float))
        n = np.maximum(np.ceil(L / COST_SLICE_TOKENS), 1.0)
        tot = {k: 0.0 for k in ("fwd", "bwd", "stored", "transient", "comm")}
        for j in range(int(n.max())):
            live = j < n
            ln = np.where(live, np.where(j == n - 1, L - (n - 1) * COST_SLICE_TOKENS, COST_SLICE_TOKENS), 8.0)
            sc = slice_costs(self.base, rc, b, ln, j * COST_SLICE_TOKENS)
            for k in ("fwd", "bwd", "stored", "comm"):
                tot[k] = tot[k] + np.where(live, sc[k], 0.0)
            tot["transient"] = np.maximum(tot["transient"], np.where(live, sc["transient"], 0.0))
        tot["peak"] = tot["stored"] + tot["transient"]
        return tot

    # the DynaPipePlanner methods that read `self.stage_costs` / `self._cache`
    from megatron.planner.dynapipe.base import DynaPipeBase as _P
    _gpt_segments = _P._gpt_segments
    segment_times = _P.segment_times
    _partitions = _P._partitions
    _feasible = _P._feasible
    del _P


# ---------------------------------------------------------------------------- slicings
def _cap(planner) -> int:
    """Longest slice the cost table has a measured shape for."""
    grid = planner.cm.profile(planner.cfg.tensor_parallel, "none").components["encoder"]
    return int(grid.axes[1][-1])


def uniform_slicing(L: int, n: int, cap: int, grid: int = SLICE_GRID) -> List[int]:
    """n slices of L tokens on the grid (L is a multiple of it: the padding), at most `cap`
    tokens and at least max(grid, MIN_SLICE_TOKENS) each."""
    n = max(n, -(-L // cap))
    n = min(n, max(1, L // max(grid, MIN_SLICE_TOKENS)))
    return uniform_slices(L, n, grid)


def dp_slicing(planner, rc: str, b: int, L: int, k_eff: float, cap: int) -> List[int]:
    """TeraPipe's slice DP on this micro-batch's shape (stage time: the slowest stage's
    forward + backward of the slice), on a grid of about 64 cells, each a multiple of `_grid`."""
    unit = _grid(planner)
    cell = -(-L // 64)
    grid = max(unit, -(-cell // unit) * unit)

    def t(ln, c):
        sc = slice_costs(planner, rc, b, ln, c)
        out = (sc["fwd"] + sc["bwd"]).max(axis=0)
        return np.where(ln > cap, np.inf, out)
    try:
        return plan_slices(L, k_eff, t, grid=grid, vectorized=True, cap_tolerance=0.01).slices
    except ValueError:
        return uniform_slicing(L, 1, cap, unit)


# ---------------------------------------------------------------------------- schedules
def expand(orders, units_of) -> List[List[ComputeOp]]:
    """Micro-batch ops -> unit ops: forwards ascend through the slices, backwards descend."""
    out = []
    for ops in orders:
        row = []
        for kind, mb, s in ops:
            us = units_of[mb] if kind == "F" else reversed(units_of[mb])
            row += [ComputeOp(kind, u, s) for u in us]
        out.append(row)
    return out


class SlicedGroup:
    def __init__(self, makespan, name, order, orders, costs, units, unit_rows, slicings):
        self.makespan, self.name, self.order, self.orders = makespan, name, order, orders
        self.costs, self.units, self.unit_rows, self.slicings = costs, units, unit_rows, slicings


def search_group(planner, rc: str, shapes, slicings, mb_orders, bound=np.inf) -> Optional[SlicedGroup]:
    """Fastest fitting schedule of micro-batches `shapes[m] = (b, L)` cut as `slicings[m]`,
    over `mb_orders` x (capped 1F1B, adaptive); None if nothing fits or beats `bound`."""
    S, avail = planner.S, planner.available
    units, unit_rows, units_of = [], [], []
    b_arr, l_arr, c_arr = [], [], []
    for m, ((b, L), sl) in enumerate(zip(shapes, slicings)):
        units_of.append(list(range(len(units), len(units) + len(sl))))
        for off, ln in zip(offsets(sl), sl):
            units.append((m, off, ln))
            unit_rows.append(b)
            b_arr.append(b), l_arr.append(ln), c_arr.append(off)
    sc = slice_costs(planner, rc, np.array(b_arr), np.array(l_arr), np.array(c_arr))
    if not (np.isfinite(sc["fwd"]).all() and np.isfinite(sc["bwd"]).all()):
        return None
    costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], sc["comm"])
    floor = lower_bound(costs)  # no order of these units beats it: skip what cannot win, stop at it
    if floor >= bound:
        return None
    agg = {k: np.stack([sc[k][:, u].sum(axis=1) for u in units_of], axis=1) for k in ("fwd", "bwd", "stored")}
    trans = np.stack([sc["transient"][:, u].max(axis=1) for u in units_of], axis=1)
    comm = np.stack([sc["comm"][:, u[0]] for u in units_of], axis=1)
    mb_costs = PipelineCosts(agg["fwd"], agg["bwd"], agg["stored"], trans, comm)
    lists = cost_lists(costs)
    best = None
    for order in mb_orders:
        if best is not None and best.makespan <= floor * (1.0 + 1e-9):
            break
        cands = []
        try:  # first: usually the winner, so its makespan prunes the 1F1B replays
            cands.append(("adaptive", _adaptive(mb_costs, order, avail)[0]))
        except ScheduleInfeasible:
            pass
        cands += [(f"1f1b-{f}", one_f_one_b(S, order, inflight=f)) for f in range(S, 0, -1)]
        for name, ops in cands:
            unit_ops = expand(ops, units_of)
            try:
                got = replay(lists, unit_ops, None, min(bound, best.makespan if best else np.inf), avail)
            except SimulationError:
                continue
            if got is not None:
                best = SlicedGroup(got[0], name, list(order), unit_ops, costs, units, unit_rows, slicings)
    return best


# ---------------------------------------------------------------------------- the planner pass
def _slicing_sets(planner, rc, shapes, fixed: int, cap: int, k_eff: float):
    grid = _grid(planner)
    if fixed > 0:
        return [[uniform_slicing(L, fixed, cap, grid) for _, L in shapes]]
    cache = planner.__dict__.setdefault("_dp_slicings", {})  # per shape, kept across iterations
    dp = []
    for b, L in shapes:
        key = (rc, b, L, round(k_eff, 1))
        if key not in cache:
            cache[key] = dp_slicing(planner, rc, b, L, round(k_eff, 1), cap)
        dp.append(cache[key])
    out = [dp]  # first: it wins most often (bench_dynapipe_slicing), so its makespan prunes the rest
    for n in AUTO_SLICES:
        sl = [uniform_slicing(L, n, cap, grid) for _, L in shapes]
        if sl not in out:
            out.append(sl)
    return out


def _candidate_partitions(planner, cands, orders, enc_all):
    """(rc, order, partition) to slice: DynaPipe's own per level, and the sliced-cost ones."""
    out = [(rc, order, p) for _, _, rc, fit, order, p in cands if rc != "full"]
    if not SLICED_COST_PARTITIONS:
        return out
    sliced = planner.__dict__.setdefault("_sliced_costs", _SlicedCostPlanner(planner))  # caches across iterations
    for rc in planner.cfg.recompute_levels:
        if rc == "full" or not planner.cm.has(planner.cfg.tensor_parallel, rc):
            continue
        for fit in ("1f1b", "single"):
            got = min(sliced._partitions(rc, fit, orders, enc_all, None, []), key=lambda x: x[1].objective,
                      default=None)
            if got is not None and not any(r == rc and p.boundaries == got[1].boundaries for r, _, p in out):
                out.append((rc, got[0], got[1]))
    return out


def plan_sliced(planner, best, cands, orders, lengths, iteration: int, t_start: float, validate: bool):
    """The sliced plan (a DynaPipeIterationPlan) or None where `--terapipe-slices auto` finds the
    unsliced `best` faster. Raises PlanningError if nothing fits."""
    from megatron.planner.dynapipe.base import DynaPipeIterationPlan, PlanningError
    c = planner.cfg
    fixed = int(c.token_slices)
    enc_all = planner._pad(np.asarray(lengths, dtype=np.int64).reshape(-1))
    bound = best[0] if best is not None and fixed <= 0 else np.inf
    cap = _cap(planner)
    win = None  # (makespan, rc, [(samples, SlicedGroup)])
    for rc, order, p in _candidate_partitions(planner, cands, orders, enc_all):
        b = p.boundaries
        samples = [order[b[k]:b[k + 1]] for k in range(len(b) - 1)]
        if len(samples) < c.data_parallel:
            continue
        groups, makespan = [], 0.0
        for g in part.balance_groups(p.times, c.data_parallel):
            shapes = [(len(samples[i]), int(enc_all[samples[i]].max())) for i in g]
            K = len(g)
            mb_orders = [list(range(K)), list(range(K))[::-1]]
            cut = min(bound, win[0] if win else np.inf)
            got = None
            for sl in _slicing_sets(planner, rc, shapes, fixed, cap, 1.0 + (planner.S - 1) / K):
                r = search_group(planner, rc, shapes, sl, mb_orders, cut if got is None else min(cut, got.makespan))
                if r is not None:
                    got = r
            if got is None:
                break
            makespan = max(makespan, got.makespan)
            groups.append(([samples[i] for i in g], got))
        else:
            if win is None or makespan < win[0]:
                win = (makespan, rc, groups)
    if win is None:
        if fixed <= 0 and best is not None:
            return None
        raise PlanningError(f"iteration {iteration}: no plan with {fixed if fixed > 0 else 'planned'} token slices "
                            f"per micro-batch fits memory_limit_mb={c.memory_limit_mb} without full recompute (a "
                            f"sliced layer replayed would write its keys/values twice); use --terapipe-slices auto "
                            f"(keeps unsliced full-recompute plans) or raise --dynapipe-memory-limit")
    if fixed <= 0 and all(len(s) == 1 for _, g in win[2] for s in g.slicings):
        return None  # one slice everywhere won: run DynaPipe's own unsliced plan (no K/V cache copies)
    planning_ms = (time.perf_counter() - t_start) * 1e3
    makespan, rc, groups = win
    group_plans = [_group_plan(planner, rc, samples, g, iteration, validate) for samples, g in groups]
    computed = sum(len(s) * int(enc_all[s].max()) for samples, _ in groups for s in samples)
    return DynaPipeIterationPlan(
        iteration=iteration, recompute=rc, groups=group_plans, makespan_ms=planner.iteration_ms(makespan),
        padding_efficiency=float(np.asarray(lengths).sum()) / computed, planning_ms=planning_ms,
        lowering_ms=(time.perf_counter() - t_start) * 1e3 - planning_ms, memory_fallback=False)


def _group_plan(planner, rc, samples, g: SlicedGroup, iteration, validate):
    """GroupPlan whose micro-batch ids are sequences in run order (what the data loader
    collates) and whose plans run units tagged with `token_slice = (sequence, offset, len)`."""
    from megatron.planner.dynapipe.base import GroupPlan
    rank_of = {old: new for new, old in enumerate(g.order)}
    # Renumber: sequences in forward order, units in (sequence, offset) order.
    units = sorted(range(len(g.units)), key=lambda u: (rank_of[g.units[u][0]], g.units[u][1]))
    new_id = {u: k for k, u in enumerate(units)}
    new_units = [(rank_of[g.units[u][0]],) + tuple(g.units[u][1:]) for u in units]
    orders = [[op._replace(microbatch=new_id[op.microbatch]) for op in ops] for ops in g.orders]
    c = planner.cfg
    mbs = [samples[old] for old in g.order]

    def rows(b):  # stages with their own DP sizes: loss-free filler rows, as DynaPipe's own plans
        return int(planner.padded_rows(b))
    shapes = [((rows(len(s)), sum(g.slicings[old])),) for old, s in zip(g.order, mbs)]
    plans = []
    if c.emit_plans:
        plans = lower_sliced([list(ops) for ops in orders], new_units,
                             [rows(g.unit_rows[u]) for u in units], c.hidden_size, dtype=c.dtype,
                             iteration=iteration, recompute=rc, validate=validate and not c.stage_parallel,
                             stage_to_rank=planner.stage_to_rank, seq_split=_seq_split(planner))
        if c.stage_parallel:  # one plan per global rank (row and, under SP, token pieces), as dynapipe_base
            from megatron.pipeline.validator import validate_plans
            from megatron.planner.passes.layout import split_plans
            plans = split_plans(plans, c.stage_parallel, c.sequence_parallel)
            if validate:
                validate_plans(plans)
    result = simulate(g.costs, g.orders)
    return GroupPlan([[int(i) for i in s] for s in mbs], shapes, g.name, float(g.makespan),
                     [float(x) for x in result.peak_memory], plans, orders, result, token_slices=new_units)
