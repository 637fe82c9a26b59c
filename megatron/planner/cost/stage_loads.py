"""T5 micro-batch partitions balanced between the encoder and the decoder half of the pipeline.

`optimal_partition` prices a micro-batch by its bottleneck stage and sums those times. For
GPT every stage runs the same layers, so that sum is each stage's total. For T5 it is not: a
long-input, short-target micro-batch is bound by the encoder stages and a short-input,
long-target one by the decoder stages, and in a full pipeline these overlap. The steady
state lasts as long as the busier half's total, E = sum of encoder-side times or D = sum of
decoder-side times, not the sum of per-micro-batch maxima, which overstates it and steers the
cut towards micro-batches that are cheap on the half that is not the bottleneck. (At 2048
tokens on the A100 T5-11B table the encoder stages carry 6.3 s per iteration and the
decoder stages 3.8 s; README, "Against the published planner", has what it changed.)

So the objective here is ``(S-1)*t_max + max(E, D)/dp``, minimised through the weighted
loads ``lam*e + (1-lam)*d`` (`optimal_partition(load=...)`, exact for each lam): at lam = 1
the minimum of (S-1)*t_max + E/dp, and if that cut has D <= E it is optimal (every cut's
objective is at least its (S-1)*t_max + E/dp, whose minimum this cut attains), likewise at
lam = 0 for D. Only when each half's optimum leaves the other half the busier one, the best of the
two and of the sum-of-maxima cut is kept (never worse than the latter by this objective; a
bisection on lam between them changed no plan on the 60 batches compared, so it is not done).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from megatron.planner.dynapipe.partitioner import Partition, optimal_partition


def _sides(p: Partition, enc: np.ndarray, dec: np.ndarray):
    b = p.boundaries
    E = float(sum(enc[i, j - i - 1] for i, j in zip(b, b[1:])))
    D = float(sum(dec[i, j - i - 1] for i, j in zip(b, b[1:])))
    return E, D


def balanced_partition(seg_time: np.ndarray, enc: np.ndarray, dec: np.ndarray, num_stages: int,
                       dp: int = 1, plain: Optional[Partition] = None) -> Partition:
    """Minimise ``(S-1)*t_max + max(E, D)/dp`` over contiguous partitions (exact where one half
    is the bottleneck at its own optimum, else the best of three cuts; see above).

    `seg_time`, `enc`, `dec`: (N, M) like `optimal_partition`'s: the bottleneck time of each
    segment and its slowest encoder-side and decoder-side stage. The returned Partition's
    `times` are bottleneck times (the DP-group split balances those), `objective` the
    balanced one, `loads` the weighted loads the winning cut summed. `plain`: the sum-of-maxima
    cut, when the caller has it already."""
    A, B = float(num_stages - 1), 1.0 / dp

    def run(lam):
        if lam is None:
            p = plain if plain is not None else optimal_partition(seg_time, num_stages, dp)
            p = Partition(p.boundaries, p.times, p.objective, p.loads)  # the caller keeps its objective
        else:
            with np.errstate(invalid="ignore"):  # inf * 0 where a segment is infeasible anyway
                load = lam * enc + (1.0 - lam) * dec
            p = optimal_partition(seg_time, num_stages, dp, load=load)
        E, D = _sides(p, enc, dec)
        p.objective = A * max(p.times) + B * max(E, D)
        return p, E, D

    p1, E, D = run(1.0)
    if D <= E:
        return p1
    p0, E, D = run(0.0)
    if E <= D:
        return p0
    return min((p1, p0, run(None)[0]), key=lambda p: p.objective)


def t5_candidates(sides: np.ndarray, num_stages: int, dp: int, guard: bool) -> List[Partition]:
    """The cuts DynaPipe schedules for one T5 order: the balanced one and, with `guard`, the
    cut by the sum of per-micro-batch maxima where it differs (both objectives are
    estimates; the simulated schedule decides). `sides`: `segment_times(..., sides=True)`."""
    old = optimal_partition(sides[..., 0], num_stages, dp) if guard else None
    got = [balanced_partition(sides[..., 0], sides[..., 1], sides[..., 2], num_stages, dp, plain=old)]
    if guard and old.boundaries != got[0].boundaries:
        got.append(old)
    return got
