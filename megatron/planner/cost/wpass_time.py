"""Time of the zero-bubble weight pass (W) per stage and micro-batch, from measured halves.

The profiler times the split backward's halves per shape (`input_grad_ms`, the input pass B,
and `weight_grad_ms`, the weight pass W; megatron/profiling/weight_pass.py) for GPT layers at
recompute "none" and for the head. A stage's W is each piece's measured share
``W / (B + W)`` of its own backward, summed over its pieces and scaled to the stage's
(calibrated) backward, so the simulator's ``I = bwd - W`` and ``W`` add up to the table's
backward. The first stage has no input pass (nothing to send back), so its W is its whole
backward, as the executor runs it.

Without the columns (the published A100 tables, T5, packed-row layers, recompute) this returns
None and the planner derives W from the forward (planner/schedule/zb_search.py), with a note.
"""
from __future__ import annotations

import warnings

import numpy as np

_noted = set()


def measured_share(pieces):
    """Sum over (count, costs) pieces of count x backward x W/(B+W), and of count x backward;
    None when a piece has no measured halves."""
    w = whole = 0.0
    for n, c in pieces:
        if "weight_grad_ms" not in c or "input_grad_ms" not in c:
            return None
        b_, w_ = np.asarray(c["input_grad_ms"], float), np.asarray(c["weight_grad_ms"], float)
        w = w + n * np.asarray(c["backward_ms"], float) * w_ / (b_ + w_)
        whole = whole + n * np.asarray(c["backward_ms"], float)
    return w, whole


def stage_wgrad(pieces, bwd_calibrated, *, first: bool):
    """W ms of one stage (see the module docstring), or None without measured halves."""
    got = measured_share(pieces)
    if got is None:
        return None
    if first:
        return np.asarray(bwd_calibrated, float)
    w, whole = got
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(bwd_calibrated, float) * np.where(whole > 0, w / whole, 0.0)


def note_derived(name: str) -> None:
    if name not in _noted:
        _noted.add(name)
        warnings.warn(f"cost model {name!r} has no measured input_grad_ms / weight_grad_ms for every piece of the "
                      f"pipeline: the zero-bubble W time is derived (fwd x 6h/(6h+s)); "
                      f"`python -m megatron.profiling.split_columns --add-to FILE` measures them", stacklevel=3)
