"""Run a layer's named operators with operator-level recompute (Aceso's per-op recompute).

A layer hands over its operators as units ``(names, fn)`` with ``fn(h, residual) -> (h,
residual)``. Consecutive units whose operators are all in the recompute set run as one
checkpoint segment (non-reentrant, TP RNG streams replayed): the segment keeps its inputs and
frees everything its operators saved; the backward pass runs it again. The segmentation is
``megatron.core.recompute.contiguous_runs``, the same function the Aceso cost model prices.
"""
from __future__ import annotations

from typing import Callable, FrozenSet, List, Sequence, Tuple, Union

import torch

from megatron.core import recompute as rc
from megatron.core.tensor_parallel import checkpoint

MLP_OPS = rc.MLP_OPS
Unit = Tuple[Tuple[str, ...], Callable]


def recompute_set(recompute: Union[str, FrozenSet[str], None]) -> FrozenSet[str]:
    """none | selective | full | '+'-joined operator names (or a set of names) -> operator set."""
    if recompute is None:
        return frozenset()
    if isinstance(recompute, str):
        return rc.decode(recompute)
    return frozenset(recompute)


def unit_flags(units: Sequence[Unit], ops: FrozenSet[str]) -> List[int]:
    flags = []
    for names, _ in units:
        hit = [n in ops for n in names]
        if any(hit) and not all(hit):
            raise ValueError(f"recompute set {rc.encode(ops)!r} splits {'+'.join(names)}, which this layer "
                             f"runs as one operator (gated MLP); flag all of them or none")
        flags.append(int(all(hit)))
    return flags


def run_ops(units: Sequence[Unit], ops: FrozenSet[str], x):
    """Run the units on the layer input ``x`` (residual stream = ``x``); returns the output."""
    h, r = x, x
    flags = unit_flags(units, ops) if ops else [0] * len(units)
    runs = rc.contiguous_runs(flags) if torch.is_grad_enabled() else []
    i = 0
    for lo, hi in runs + [(len(units), len(units))]:
        for _, fn in units[i:lo]:
            h, r = fn(h, r)
        if hi > lo:
            seg = units[lo:hi]
            if any(n in rc.RESIDUAL_OF for names, _ in seg for n in names):
                h, r = checkpoint(_segment(seg), h, r)
            else:  # the residual is not an input: the segment must not keep it alive
                h, r_new = checkpoint(_segment(seg), h, None)
                r = r if r_new is None else r_new
        i = hi
    return h


def _segment(units: Sequence[Unit]):
    def run(h, r):
        for _, fn in units:
            h, r = fn(h, r)
        return h, r
    return run
