"""TeraPipe (ICML'21): pipelining along the token dimension of a causal LM.

Stage k may run tokens [c, c+l) of a sequence while stage k+1 runs the slice before it,
because causal attention only looks back (the keys/values of earlier slices are cached,
megatron/models/sliced_attention.py). This module is the planner side:

* `build_terapipe_plans`: one *unit* per (sequence micro-batch, slice), run GPipe-style (all
  forwards in order, then all backwards in reverse, so the slices of a sequence go backward
  in reverse, as the key/value gradients require); lowered by the shared lowering, then every
  instruction of a unit is tagged with its `token_slice = (sequence, offset, length)`.
* `plan_slices`: TeraPipe's dynamic program over slicings (positions on a grid of 8 tokens):
  for every cap t_max on a slice's time, the slicing of the sequence that minimises
  ``sum t_i`` with every ``t_i <= t_max``, scored ``sum t_i + (K-1) * max t_i`` for K stages;
  t_max is enumerated ascending and the search stops once ``K * t_max`` (a lower bound of any
  later score) exceeds the best score. `plan_batch` adds the batch dimension (how many
  sequences per micro-batch), with uniform micro-batches as the trainer runs them.
* `uniform_slices`, `parse_slices`: the `--terapipe-slices N|l1,l2,...` options.
* `slice_memory_mb`: the activation + cached key/value memory of a slicing, checked against
  a limit.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from megatron.pipeline.lowering import ComputeOp, lower_to_plans
from megatron.planner.dynapipe.native import cpp as _cpp
from megatron.config.terapipe import SLICE_GRID, parse_slices, slice_offsets, uniform_slices  # noqa: F401 (re-exported)

GRID = SLICE_GRID  # slice boundaries lie on a grid of this many tokens
# The exact slice DP (every distinct slice time as a cap) plans in under 50 ms of CPU up to 1024
# tokens (7-38 ms for GPT-6.7B's A100 table, batch 1-4); beyond, caps 0.1 % apart stay within
# 0.0087 % of the exact score (2048-8192 tokens) at 3-270 ms, where exact takes 0.2-38 s.
EXACT_MAX_TOKENS = 1024
FINE_CAP_TOLERANCE = 0.001


def default_cap_tolerance(seq_len: int) -> float:
    return 0.0 if seq_len <= EXACT_MAX_TOKENS else FINE_CAP_TOLERANCE


# ---------------------------------------------------------------------------- plan building
def slice_units(slicings: Sequence[Sequence[int]]) -> List[tuple]:
    """[(sequence, offset, length)] in forward order: the sequences one after another, each
    slice by slice."""
    units = []
    for seq, lengths in enumerate(slicings):
        off = 0
        for ln in lengths:
            if ln <= 0:
                raise ValueError(f"slice lengths must be positive, got {list(lengths)} for sequence {seq}")
            units.append((seq, off, ln))
            off += ln
    return units


def build_terapipe_plans(slicings: Sequence[Sequence[int]], microbatch_shapes: Sequence[tuple], pp_size: int,
                         hidden_size: int, dtype: str = "float32", iteration: int = 0,
                         recompute: str = "none", validate: bool = True, seq_split: int = 1,
                         num_model_chunks: int = 1) -> list:
    """Per-rank plans running every sequence micro-batch (`microbatch_shapes[i] = ((b, s),)`)
    in the slices `slicings[i]` (lengths summing to s). The units are the plan's micro-batches.
    `seq_split` (the TP size under --sequence-parallel): stages exchange [l / seq_split, b, h]
    chunks of each slice, so every slice length must be a multiple of it.
    `num_model_chunks` > 1 (--num-layers-per-virtual-pipeline-stage): virtual stage v * PP + r
    runs on rank r (as the static interleaved schedule places them). Each rank runs groups of
    PP units (Megatron's interleaved grouping): the group's forwards on its first chunk, then
    on its second, ...; all backwards after, in exactly the reverse order, so every
    (sequence, stage) still sees its slices forward in order and backward in reverse."""
    if len(slicings) != len(microbatch_shapes):
        raise ValueError(f"{len(slicings)} slicings for {len(microbatch_shapes)} micro-batches")
    units = slice_units(slicings)
    for seq, lengths in enumerate(slicings):
        b, s = microbatch_shapes[seq][0]
        if sum(lengths) != s:
            raise ValueError(f"slices {list(lengths)} of micro-batch {seq} cover {sum(lengths)} tokens, "
                             f"its sequence has {s}")
        if any(ln % seq_split for ln in lengths):
            raise ValueError(f"--sequence-parallel splits each token slice over {seq_split} TP ranks: slices "
                             f"{list(lengths)} of micro-batch {seq} must be multiples of {seq_split}")
    n = len(units)
    orders = []
    for r in range(pp_size):
        fwd = [ComputeOp("F", u, v * pp_size + r) for g in range(0, n, pp_size) for v in range(num_model_chunks)
               for u in range(g, min(g + pp_size, n))]
        orders.append(fwd + [ComputeOp("B", op.microbatch, op.stage) for op in reversed(fwd)])
    return lower_sliced(orders, units, [microbatch_shapes[seq][0][0] for seq, _, _ in units], hidden_size,
                        dtype=dtype, iteration=iteration, recompute=recompute, validate=validate,
                        stage_to_rank=[s % pp_size for s in range(pp_size * num_model_chunks)], seq_split=seq_split)


def lower_sliced(orders, units: Sequence[tuple], unit_rows: Sequence[int], hidden_size: int,
                 dtype: str = "float32", iteration: int = 0, recompute: str = "none",
                 validate: bool = True, stage_to_rank: Optional[Sequence[int]] = None, seq_split: int = 1) -> list:
    """Per-rank plans of per-rank unit orders (`ComputeOp`s whose micro-batch is a unit id; stage
    s on rank `stage_to_rank[s]`, default one stage per rank): unit u is token slice
    `units[u] = (sequence, offset, length)` of `unit_rows[u]` rows; every instruction of a unit is
    tagged with its `token_slice`. Stages exchange [length / seq_split, rows, hidden]. Shared by
    TeraPipe (GPipe order) and DynaPipe's sliced micro-batches (megatron/planner/dynapipe/slicing.py)."""
    unit_shapes = [((int(b), int(ln)),) for b, (_, _, ln) in zip(unit_rows, units)]

    def shapes(u, stage):
        b, ln = unit_shapes[u][0]
        return ((ln // seq_split, b, hidden_size),)

    plans = lower_to_plans(orders, list(stage_to_rank) if stage_to_rank is not None else list(range(len(orders))),
                           unit_shapes, shapes, recompute=recompute,
                           dtype=dtype, iteration=iteration, validate=False)
    for plan in plans:
        plan.instructions = [dataclasses.replace(ins, token_slice=tuple(units[ins.microbatch]))
                             if hasattr(ins, "token_slice") else ins for ins in plan.instructions]
    if validate:
        from megatron.pipeline.validator import validate_plans
        validate_plans(plans)
    return plans


# ---------------------------------------------------------------------------- the DP
@dataclass
class SlicePlan:
    slices: List[int]         # token lengths, in order
    times: List[float]        # predicted per-slice stage time (forward + backward)
    score: float              # sum t_i + (K - 1) * max t_i
    t_max_tried: int = 0
    planning_s: float = 0.0


def pipeline_score(times: Sequence[float], num_stages: int) -> float:
    return sum(times) + (num_stages - 1) * max(times)


def _cost_matrix(points, t, vectorized: bool) -> np.ndarray:
    P = len(points)
    pts = np.asarray(points, dtype=np.float64)
    M, N = np.meshgrid(np.arange(P), np.arange(P), indexing="ij")
    upper = M < N
    cost = np.full((P, P), np.inf)
    L, C = (pts[N] - pts[M])[upper], pts[M][upper]
    if vectorized:
        cost[upper] = np.broadcast_to(np.asarray(t(L.astype(np.int64), C.astype(np.int64)), dtype=np.float64),
                                      L.shape)
    else:
        cost[upper] = [float(t(int(l), int(c))) for l, c in zip(L, C)]
    return cost


def _dp_for_caps(cost: np.ndarray, caps: np.ndarray):
    """f[k, n] = min over m < n with cost[m, n] <= caps[k] of f[k, m] + cost[m, n], for all caps
    at once. Returns (f, arg). The C++ loop (megatron/planner/dynapipe/partition.cpp) when it is built."""
    if _cpp is not None:
        return _cpp.dp_for_caps(cost, np.asarray(caps, dtype=np.float64))
    return _dp_for_caps_numpy(cost, caps)


def _dp_for_caps_numpy(cost: np.ndarray, caps: np.ndarray):
    """The same, one vector operation per end point n."""
    P, K = cost.shape[0], len(caps)
    f = np.full((K, P), np.inf)
    arg = np.full((K, P), -1, dtype=np.int64)
    f[:, 0] = 0.0
    rows = np.arange(K)
    cap_max = caps.max()
    for n in range(1, P):
        col = cost[:n, n]
        ok = np.flatnonzero(col <= cap_max)  # starts whose slice fits under some cap
        if not len(ok):
            continue
        lo = int(ok[0])
        col = col[lo:]
        cand = np.where(col[None, :] <= caps[:, None], f[:, lo:n] + col[None, :], np.inf)
        m = np.argmin(cand, axis=1)
        f[:, n] = cand[rows, m]
        arg[:, n] = m + lo
    return f, arg


def _thin(caps: np.ndarray, tol: float) -> np.ndarray:
    """One cap per geometric bin of ratio (1 + tol) (the smallest of the bin; the largest cap
    always kept). `caps` is sorted and positive."""
    if len(caps) < 2 or caps[0] <= 0:
        return caps
    bins = np.floor(np.log(caps / caps[0]) / np.log1p(tol)).astype(np.int64)
    _, first = np.unique(bins, return_index=True)
    keep = caps[first]
    return keep if keep[-1] == caps[-1] else np.append(keep, caps[-1])


def _scan_caps(cost, caps, points, num_stages, mem_ok, chunk, best, tried):
    P = len(points)
    for lo in range(0, len(caps), chunk):
        batch = caps[lo:lo + chunk]
        if best is not None:
            batch = batch[num_stages * batch < best.score]
            if not len(batch):
                break
        f, arg = _dp_for_caps(cost, batch)
        tried += len(batch)
        for k in range(len(batch)):
            if not np.isfinite(f[k, -1]):
                continue
            cuts, n = [], P - 1
            while n > 0:
                cuts.append(n)
                n = int(arg[k, n])
            cuts.append(0)
            cuts.reverse()
            slices = [points[b] - points[a] for a, b in zip(cuts, cuts[1:])]
            times = [float(cost[a, b]) for a, b in zip(cuts, cuts[1:])]
            if mem_ok is not None and not mem_ok(slices):
                continue
            score = pipeline_score(times, num_stages)
            if best is None or score < best.score - 1e-12:
                best = SlicePlan(slices, times, score)
    return best, tried


def plan_slices(seq_len: int, num_stages: int, t: Callable, grid: int = GRID,
                mem_ok: Optional[Callable[[List[int]], bool]] = None, cap_tolerance: Optional[float] = None,
                vectorized: bool = False, chunk: int = 64) -> SlicePlan:
    """TeraPipe's DP for one sequence (batch fixed inside `t`).

    `t(l, c)` is the stage time of a slice of l tokens after c context tokens (with
    `vectorized`, it takes numpy arrays). Slice boundaries lie on a grid of `grid` tokens
    (the last cell is shorter when seq_len is not a multiple). For each cap t_max taken from
    the distinct t values, ascending, f[n] = min over the last slice [m, n) of
    f[m] + t(n - m, m) with t <= t_max; the slicing of f[N] is scored
    ``sum t_i + (K - 1) max t_i``; enumeration stops once K * t_max >= the best score (no
    later cap can win). Caps below the smallest feasible one (every grid cell must fit) are
    skipped; the remaining ones run `chunk` at a time through one vectorised DP.
    `cap_tolerance` > 0 is the fast mode for long sequences: a coarse pass over caps a factor
    1 + 8 * tol apart, then the caps within that factor of the coarse winner's max t_i,
    1 + tol apart (an approximation; 0 = exact; None = `default_cap_tolerance`).
    `mem_ok(slices)` rejects slicings over the memory
    limit; the DP itself is not memory-aware, so uniform slicings that fit are scored too."""
    t0 = time.perf_counter()
    if seq_len <= 0:
        raise ValueError(f"sequence length must be positive, got {seq_len}")
    if cap_tolerance is None:
        cap_tolerance = default_cap_tolerance(seq_len)
    points = list(range(0, seq_len, grid)) + [seq_len]
    P = len(points)
    cost = _cost_matrix(points, t, vectorized)
    finite = cost[np.isfinite(cost)]
    lowest = max(float(cost[n - 1, n]) for n in range(1, P))  # every cell alone must fit
    all_caps = np.unique(finite[finite >= lowest])
    best: Optional[SlicePlan] = None
    tried = 0
    if cap_tolerance > 0 and len(all_caps) > 1:
        # Coarse pass (caps 8x further apart), then the caps near the coarse winner at the
        # requested spacing.
        coarse = _thin(all_caps, 8 * cap_tolerance)
        best, tried = _scan_caps(cost, coarse, points, num_stages, mem_ok, max(1, chunk // 4), None, 0)
        if best is not None:
            c = max(best.times)
            near = all_caps[(all_caps >= c / (1 + 8 * cap_tolerance)) & (all_caps <= c * (1 + 8 * cap_tolerance))]
            best, tried = _scan_caps(cost, _thin(near, cap_tolerance), points, num_stages, mem_ok, chunk, best,
                                     tried)
    else:
        best, tried = _scan_caps(cost, all_caps, points, num_stages, mem_ok, chunk, None, 0)
    if mem_ok is not None:
        # The DP minimises time only; when its slicings overflow memory, uniform slicings
        # (down to the unsliced sequence) are the fallback candidates.
        for n in range(1, P):
            slices = uniform_slices(seq_len, n)
            if not mem_ok(slices):
                continue
            offs = [sum(slices[:i]) for i in range(n)]
            times = [float(cost[points.index(c), points.index(c + ln)]) if c + ln in points and c in points
                     else float(t(ln, c)) for ln, c in zip(slices, offs)]
            score = pipeline_score(times, num_stages)
            if best is None or score < best.score - 1e-12:
                best = SlicePlan(slices, times, score)
    if best is None:
        raise ValueError(f"no slicing of {seq_len} tokens fits the memory limit; lower --micro-batch-size or "
                         f"raise the memory limit")
    best.t_max_tried = tried
    best.planning_s = time.perf_counter() - t0
    return best


def brute_force_slices(seq_len: int, num_stages: int, t: Callable[[int, int], float], grid: int = GRID,
                       mem_ok=None) -> SlicePlan:
    """Every slicing on the grid, scored exactly (tests only: 2^(N/grid) slicings)."""
    points = list(range(0, seq_len, grid)) + [seq_len]
    inner = points[1:-1]
    best = None
    for mask in range(1 << len(inner)):
        cuts = [0] + [p for i, p in enumerate(inner) if mask >> i & 1] + [seq_len]
        slices = [b - a for a, b in zip(cuts, cuts[1:])]
        if mem_ok is not None and not mem_ok(slices):
            continue
        times = [t(b - a, a) for a, b in zip(cuts, cuts[1:])]
        score = pipeline_score(times, num_stages)
        if best is None or score < best.score - 1e-12:
            best = SlicePlan(slices, times, score)
    return best


def plan_batch(batch: int, seq_len: int, num_stages: int, t: Callable, grid: int = GRID, mem_ok=None,
               **kw):
    """TeraPipe's batch dimension: run `batch` sequences as m = batch / b micro-batches of b
    sequences, each cut into the same slices. All m * n units run back to back, so the
    iteration takes ``m * sum t_i + (K - 1) * max t_i = m * (sum t_i + (1 + (K-1)/m - 1) * max t_i)``:
    the slice DP with an effective stage count 1 + (K-1)/m. Every divisor b of `batch` is
    tried (the trainer's micro-batches are uniform). `t(b, l, c)`; returns
    (b, SlicePlan with `score` = the whole iteration's predicted time)."""
    best = None
    for b in range(1, batch + 1):
        if batch % b:
            continue
        m = batch // b
        try:
            sp = plan_slices(seq_len, 1 + (num_stages - 1) / m, lambda l, c, b=b: t(b, l, c), grid,
                             None if mem_ok is None else (lambda s, b=b: mem_ok(b, s)), **kw)
        except ValueError:
            continue
        sp.score *= m
        if best is None or sp.score < best[1].score:
            best = (b, sp)
    if best is None:
        raise ValueError(f"no micro-batch size dividing {batch} sequences fits the memory limit")
    return best


# ---------------------------------------------------------------------------- memory
def slice_memory_mb(slices: Sequence[int], b: int, layers: int, hidden: int, kv_hidden: int, heads: int,
                    bytes_per: int = 4, act_per_token_mb: Optional[float] = None, recompute: str = "none") -> float:
    """Peak activation memory of one stage running one sequence of `slices` (GPipe: every
    slice is in flight at the end of the forwards). Per layer: the cached K/V of the whole
    sequence (2 * kv_hidden per token), each slice's saved concatenated K/V of c + l rows, and
    the per-token activations (`act_per_token_mb` per token per layer, default 16 * hidden
    bytes as Megatron's estimate without attention scores) plus its heads x l x (c + l) attention probabilities.
    `recompute` "selective" drops the probabilities (recomputed); "full" keeps only each
    layer's input (hidden per token) besides the K/V: the slice's own k, v and the leaf of the
    earlier slices' c rows stay alive until its backward either way."""
    mb = 1.0 / 2 ** 20
    per_tok = act_per_token_mb if act_per_token_mb is not None else 16 * hidden * bytes_per * mb
    if recompute == "full":
        per_tok = hidden * bytes_per * mb
    probs = 0.0 if recompute in ("full", "selective") else 1.0
    total, c = 0.0, 0
    for ln in slices:
        ctx = c + ln
        total += layers * b * (ln * per_tok + 2 * kv_hidden * (ctx + ln) * bytes_per * mb
                               + probs * heads * ln * ctx * bytes_per * mb)
        c = ctx
    return total


def slice_times(stage_ms, b: int, lengths) -> list:
    """A rank's time per unit for one micro-batch of `b` rows cut into `lengths`: each slice
    after the context of the slices before it."""
    return [stage_ms(b, ln, c) for ln, c in zip(lengths, slice_offsets(lengths))]
