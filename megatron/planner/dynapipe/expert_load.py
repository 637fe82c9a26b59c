"""Expert-load-aware DynaPipe (issue 47, item 6): the busiest expert rank's tokens, not the
mean, decide a micro-batch's expert time.

With expert parallelism every EP rank (EP ranks are data-parallel ranks) runs its i-th
micro-batch in lockstep with the others: the all-to-all of step i carries the tokens of all
EP ranks' i-th micro-batches, and the step lasts as long as the rank whose experts received
the most of them. A load-blind plan prices every micro-batch at the mean (skew 1) and pairs
the DP groups' micro-batches in whatever order each group runs them; when the routing
follows the data (a task whose tokens go to one expert, long documents of one kind), the same
kind of micro-batch meets itself at the same step and one rank computes while the others wait.

Routing statistics come per sample (`Routing`): the share of its tokens' routed pairs each
expert gets, e.g. from the previous iteration's router counts per task or token class (the MoE
layer logs them: megatron/training/moe_hooks.py), and the padding's: a micro-batch pads its
samples to its longest, and the pad tokens are routed too (by the pad token's own routing, or
like the sample's tokens where the padding repeats them). `step_loads` gives each EP rank's
tokens per step; `pair_by_load` re-pairs the DP groups' micro-batches (group 0 keeps DynaPipe's
order; each other group's micro-batch for a step is chosen greedily, heaviest steps first, to
minimise that step's busiest rank), and `predict_ms` prices a pairing with the MoE cost model,
each rank's MoE layers at the tokens its experts receive (one pipeline stage per rank: the
steps add up; with PP > 1 the pairing still balances each step, but its price here ignores the
pipeline's overlap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron.planner.cost.moe_cost import MoECostModel


@dataclass
class Routing:
    """Per-sample routing statistics: `lengths` (N,) padded sample lengths, `frac` (N, E) routed
    pairs per token to each expert (rows sum to top-k), `pad_frac` (E,) the same for the padding
    a micro-batch adds to its shorter samples (None: it routes like its sample's tokens)."""
    lengths: np.ndarray
    frac: np.ndarray
    pad_frac: Optional[np.ndarray] = None


def class_routing(padded_lengths, classes, class_counts: np.ndarray, topk: int, pad_counts=None) -> Routing:
    """`Routing` from router counts per task or token class (rows of `class_counts`, e.g. the
    counts the MoE layers log, summed per class), and optionally the padding's."""
    def norm(c):
        c = np.asarray(c, float)
        return topk * c / c.sum(axis=-1, keepdims=True)
    return Routing(np.asarray(padded_lengths, float), norm(class_counts)[np.asarray(classes)],
                   None if pad_counts is None else norm(pad_counts))


def rank_tokens(routing: Routing, mb: Sequence[int], ep: int) -> np.ndarray:
    """(EP,) routed tokens each EP rank's experts receive from micro-batch `mb`, padded to its
    longest sample (experts are split over the ranks in order: rank r holds experts
    [r E/EP, (r+1) E/EP))."""
    mb = list(mb)
    if not mb:
        return np.zeros(ep)
    n, f = routing.lengths[mb], routing.frac[mb]
    pad = routing.lengths[mb].max() - n
    t = (n[:, None] * f).sum(axis=0)
    t = t + (pad[:, None] * f).sum(axis=0) if routing.pad_frac is None else t + pad.sum() * routing.pad_frac
    return t.reshape(ep, -1).sum(axis=1)


def step_loads(groups: List[List[List[int]]], routing: Routing, ep: int) -> np.ndarray:
    """(steps, EP) tokens per EP rank at each lockstep step (every group runs the same number of
    micro-batches: the EP exchange pairs them)."""
    n = {len(g) for g in groups}
    if len(n) != 1:
        raise ValueError(f"EP ranks exchange tokens every micro-batch: every DP group needs the same number of "
                         f"micro-batches, got {[len(g) for g in groups]}")
    return np.array([sum(rank_tokens(routing, g[i], ep) for g in groups) for i in range(n.pop())])


def equal_counts(groups: List[List[List[int]]]) -> List[List[List[int]]]:
    """Every DP group with as many micro-batches as the longest: a shorter group's micro-batch
    with the most samples is split in two (order kept) until it has enough. DynaPipe balances
    the groups' times, not their counts; EP's lockstep exchange needs equal counts."""
    n = max(len(g) for g in groups)
    out = []
    for g in groups:
        g = [list(mb) for mb in g]
        while len(g) < n:
            j = max(range(len(g)), key=lambda i: len(g[i]))
            if len(g[j]) < 2:
                raise ValueError(f"a DP group has {len(g)} single-sample micro-batches, others {n}: cannot give "
                                 "every group the same count (EP's exchange needs it)")
            half = len(g[j]) // 2
            g[j:j + 1] = [g[j][:half], g[j][half:]]
        out.append(g)
    return out


def pair_by_load(groups: List[List[List[int]]], routing: Routing, ep: int) -> List[List[List[int]]]:
    """The same micro-batches, each group's reordered so that the steps' busiest ranks are as
    light as a greedy pairing gets them (see the module doc). Group 0 keeps its order."""
    out = [list(groups[0])]
    acc = np.array([rank_tokens(routing, mb, ep) for mb in groups[0]])
    for g in groups[1:]:
        loads = [rank_tokens(routing, mb, ep) for mb in g]
        free, slot = set(range(len(g))), [None] * len(g)
        for i in np.argsort(-acc.max(axis=1), kind="stable"):  # heaviest step first
            j = min(sorted(free), key=lambda j: ((acc[i] + loads[j]).max(), -loads[j].sum()))
            free.discard(j)
            slot[i] = g[j]
            acc[i] = acc[i] + loads[j]
        out.append(slot)
    return out


def predict_ms(cm: MoECostModel, groups, routing: Routing, num_layers: int, recompute: str = "none", tp: int = 1,
               load_aware: bool = True) -> float:
    """Forward + backward ms of `num_layers` layers over the steps of `groups` (one stage per rank:
    steps add up; a step lasts as long as its slowest rank). `load_aware`: each rank's MoE layers
    at the tokens its experts receive that step (skew = those over its own routed tokens), where
    the DP groups are the EP ranks (EP = DP); with more DP groups than EP ranks, every group at
    the step's busiest rank. Else skew 1 (what a load-blind planner believes)."""
    p = cm.pricing
    loads = step_loads(groups, routing, p.ep)
    lengths = routing.lengths
    total = 0.0
    for i, step in enumerate(loads):
        worst = 0.0
        for d, g in enumerate(groups):
            mb = g[i]
            seq, rows = float(lengths[mb].max()), float(len(mb))
            own = rows * seq * p.topk
            got = step[d] if len(groups) == p.ep else step.max()
            skew = float(np.clip(got / own, 1e-3, p.ep)) if load_aware else 1.0
            c = cm.with_skew(skew).layer("encoder", tp, recompute, rows, seq)
            worst = max(worst, float(c["forward_ms"] + c["backward_ms"]) * num_layers)
        total += worst
    return total
