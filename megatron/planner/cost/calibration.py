"""What a per-layer table leaves out of a training step, fitted on the host that trains.

A cost table times each layer alone in a warm loop. A training step on the same host adds
three things the table cannot see, and the planners' predictions were 27-43 % low on the CPU
box without them (issue 25):

* ``compute_scale``: ranks that share a host's cores and memory slow each other down while
  they compute at once (on the 2-vCPU CI box two ranks running the same layer concurrently
  take 2x as long each). A pipeline overlaps its ranks' work part of the time, so the step
  sees a fraction of that. On a GPU per rank this stays near 1.
* ``op_overhead_ms``: per forward or backward instruction, the executor's bookkeeping, batch
  slicing, autograd entry and exit and the point-to-point handshake: paid once per micro-batch
  per stage in each direction (TeraPipe: once per token slice).
* ``step_overhead_ms``: once per iteration, outside the pipeline: optimizer step, zeroing
  gradients, the loss/token all-reduces, the tied-embedding and gradient-norm reductions.

The planners apply the first two to every op they price (so a plan with more micro-batches
or slices pays for them, as it does when it runs) and add the third to the iteration time they
report. The numbers are fitted by `megatron.profiling.calibrate` from short real training runs
(uniform micro-batches, plain 1F1B) and stored in the table they correct; they hold for that
model on that host and data-parallel size 1 (a data-parallel gradient reduction is not in them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class HostCalibration:
    compute_scale: float = 1.0
    op_overhead_ms: float = 0.0
    step_overhead_ms: float = 0.0
    meta: Dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("compute_scale", "op_overhead_ms", "step_overhead_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"calibration {name} must be a finite number >= 0, got {v!r}")
        if self.compute_scale <= 0:
            raise ValueError(f"calibration compute_scale must be > 0, got {self.compute_scale!r}")

    @property
    def identity(self) -> bool:
        return (self.compute_scale, self.op_overhead_ms, self.step_overhead_ms) == (1.0, 0.0, 0.0)

    def op_ms(self, table_ms):
        """One forward or backward instruction: the table's time as the step sees it."""
        return np.multiply(table_ms, self.compute_scale) + self.op_overhead_ms

    def to_dict(self) -> dict:
        return {"compute_scale": round(self.compute_scale, 4), "op_overhead_ms": round(self.op_overhead_ms, 4),
                "step_overhead_ms": round(self.step_overhead_ms, 3), "meta": self.meta}

    @classmethod
    def from_dict(cls, doc: Optional[dict], where: str = "cost model") -> "HostCalibration":
        if doc is None:
            return IDENTITY
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: 'calibration' must be an object, got {type(doc).__name__}")
        vals = {}
        for name, default in (("compute_scale", 1.0), ("op_overhead_ms", 0.0), ("step_overhead_ms", 0.0)):
            v = doc.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{where}: calibration {name} must be a number, got {v!r}; re-run "
                                 "python -m megatron.profiling.calibrate")
            vals[name] = float(v)
        try:
            return cls(**vals, meta=dict(doc.get("meta") or {}))
        except ValueError as e:
            raise ValueError(f"{where}: {e}; re-run python -m megatron.profiling.calibrate") from None


IDENTITY = HostCalibration()

# The search range of `fit`: compute slow-downs from none to the full sharing of two ranks on
# one core, per-op overheads up to 10 ms (gloo on a 2-vCPU host: ~2 ms a message; a GPU job
# pays tens of microseconds);
# a coarse grid, then a fine one around its best point.
SCALE_RANGE, OVERHEAD_RANGE = (1.0, 2.5), (0.0, 10.0)
COARSE, FINE = (0.05, 0.25), (0.01, 0.05)


def fit(measured_ms: Sequence[float], predict: Callable[[float, float], Sequence[float]]) -> HostCalibration:
    """The calibration that best explains `measured_ms` (one iteration time per run).

    `predict(compute_scale, op_overhead_ms)` gives the pipeline's simulated time of every run
    with those two applied (a pipeline's time is not linear in them: bubbles move). For each
    pair the step overhead is the least-squares constant of the relative errors (clamped at 0);
    the pair with the smallest sum of squared relative errors wins."""
    y = np.asarray(measured_ms, dtype=np.float64)
    if y.ndim != 1 or len(y) < 3 or not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"calibration needs >= 3 positive measured iteration times, got {list(y)}")
    w2 = 1.0 / y ** 2  # relative errors

    def score(a, g):
        p = np.asarray(predict(float(a), float(g)), dtype=np.float64)
        if not np.all(np.isfinite(p)):
            return None
        beta = max(0.0, float(np.sum(w2 * (y - p)) / np.sum(w2)))
        return float(np.sum(w2 * (p + beta - y) ** 2)), float(a), float(g), beta, p + beta

    def search(scales, overheads, best=None):
        for a in scales:
            for g in overheads:
                s = score(a, g)
                if s is not None and (best is None or s[0] < best[0]):
                    best = s
        return best

    def axis(lo, hi, step, centre=None, coarse=None):
        if centre is not None:
            lo, hi = max(lo, centre - coarse), min(hi, centre + coarse)
        return np.round(np.arange(lo, hi + step / 2, step), 4)

    best = search(axis(*SCALE_RANGE, COARSE[0]), axis(*OVERHEAD_RANGE, COARSE[1]))
    if best is None:
        raise ValueError("calibration: the model predicts no finite time for these runs")
    best = search(axis(*SCALE_RANGE, FINE[0], best[1], COARSE[0]),
                  axis(*OVERHEAD_RANGE, FINE[1], best[2], COARSE[1]), best)
    err, a, g, beta, pred = best
    rel = (pred - y) / y
    return HostCalibration(a, g, beta, {"runs": len(y), "max_abs_error": round(float(np.max(np.abs(rel))), 4),
                                        "rms_error": round(float(np.sqrt(np.mean(rel ** 2))), 4)})
