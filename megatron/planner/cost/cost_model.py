"""Profiled per-layer cost model used by the planners.

A cost model answers, for one transformer layer of a component (``encoder`` = GPT or T5
encoder layer, ``decoder`` = T5 decoder layer, ``postprocess`` = final norm + output head +
loss), a tensor-parallel size, a recomputation level and a micro-batch shape:
forward/backward time (ms), activation memory the layer keeps for backward (``stored``,
MB) and its transient peak (``peak``, MB); plus parameter memory per layer.

Values between measured grid points are interpolated linearly in the micro-batch size and,
along sequence lengths, in a basis exact for attention's s^2 term (memory) or linearly
(times); past the largest length a quadratic fit extrapolates where it predicts held-out grid
points within 2 % (`grid_interp`). A query past the largest micro-batch size, past that, or
touching a grid cell that was never measured (it ran out of memory), is infeasible: every
returned quantity is ``inf``. Below the smallest value
of an axis the cost is clamped to it (a shorter sequence is never more expensive; this
keeps tiny test shapes usable).

File format (JSON, ``"format": "megatron-planner-cost-model"``, ``"version": 1``) is
documented in ``cost_models/README.md``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Sequence

import numpy as np

from megatron.planner.cost import cost_model_checks as checks
from megatron.planner.cost import grid_interp as gi
FORMAT_NAME = "megatron-planner-cost-model"
FORMAT_VERSION = 2  # 2 adds the optional per-component "attention_split" (see attention_cost.py)
READ_VERSIONS = (1, 2)
RECOMPUTE_LEVELS = ("none", "selective", "full")
# input_grad_ms / weight_grad_ms (optional, layers and head at recompute "none"): the two halves
# of the split backward, timed (megatron/profiling/weight_pass.py); without them the zero-bubble
# planner derives W from the forward (planner/schedule/zb_search.py).
QUANTITIES = ("forward_ms", "backward_ms", "stored_mb", "peak_mb", "input_grad_ms", "weight_grad_ms")
# Axes per component: micro-batch size first, then sequence lengths.
COMPONENT_AXES = {
    "encoder": ("mbs", "seq"),
    "decoder": ("mbs", "enc_seq", "dec_seq"),
    "postprocess": ("mbs", "seq"),
    # Optional (issue 30): the embedding of the first stage (and T5's first decoder stage).
    "preprocess": ("mbs", "seq"),
}

# Length axes whose memory grows with their square (self-attention scores): the T5 decoder's
# cross-attention is linear in the encoder length; embedding, head and loss have no s^2 term
# (their peak is the larger of two terms linear in the tokens).
S2_AXES = {"encoder": (1,), "decoder": (2,), "postprocess": (), "preprocess": ()}


class CostModelError(ValueError):
    pass


class Grid:
    """Dense multilinear interpolation table; NaN marks a shape that was not measured."""

    def __init__(self, axes: Sequence[Sequence[float]], values: Dict[str, np.ndarray]):
        self.axes = [np.asarray(a, dtype=np.float64) for a in axes]
        for a in self.axes:
            if a.ndim != 1 or len(a) == 0 or np.any(np.diff(a) <= 0):
                raise CostModelError(f"grid axis must be non-empty and strictly increasing: {a}")
        shape = tuple(len(a) for a in self.axes)
        self.values = {}
        for k, v in values.items():
            arr = np.asarray(v, dtype=np.float64)
            if arr.shape != shape:
                raise CostModelError(f"grid {k!r} has shape {arr.shape}, axes give {shape}")
            self.values[k] = arr
        # All quantities side by side, flattened: one gather per corner serves them all.
        self._names = list(self.values)
        self._flat = np.stack([self.values[k] for k in self._names], axis=-1).reshape(-1, len(self._names))
        self._strides = [int(np.prod(shape[a + 1:])) for a in range(len(shape))]

        self.curved = ()

    def set_curved(self, axes: Sequence[int], quadratic_axes: Sequence[int] | None = None) -> None:
        """Give `axes` (sequence lengths) the s^2-aware lookup of `grid_interp`: memory
        interpolated in a quadratic basis, every quantity extrapolated where a held-out fit
        allows. A cost model does this for all its length axes; other users of `Grid` (the
        TeraPipe latency table) keep plain multilinear lookup. `quadratic_axes` (default: all
        of `axes`) are those whose memory has an s^2 term; the others stay linear inside the
        grid (fewer stencil points)."""
        self.curved = tuple(axes)
        quad_axes = tuple(self.curved if quadratic_axes is None else quadratic_axes)
        self._groups = []
        for quad in ((), quad_axes) if quad_axes else ((),):
            names = [k for k in self._names if k.endswith("_mb") == bool(quad)] if quad_axes else list(self._names)
            if not names:
                continue
            cols = [np.ascontiguousarray(self.values[k]).reshape(-1) for k in names]
            ok = {a: [gi.extrapolation_ok(self.values[k], self.axes[a], a).reshape(-1) for k in names]
                  for a in self.curved}
            self._groups.append((names, quad, cols, ok))

    def _curved_call(self, flat, out_shape) -> Dict[str, np.ndarray]:
        out, prepared = {}, {}

        def prep(rows, *mode):  # stencils depend on the mode only: share them between groups
            if rows is None:
                if mode not in prepared:
                    prepared[mode] = gi.prepare(self.axes, flat, self.curved, *mode)
                return prepared[mode]
            return gi.prepare(self.axes, [c[rows] for c in flat], self.curved, *mode)

        for names, quad, values, ok in self._groups:
            acc = gi.lookup(values, self._strides, ok, prep(None, quad, False))
            # a quadratic stencil touching a null point: the left stencil alone, else linear
            for mode in ((quad, True), ((), False)) if quad else ():
                redo = np.isnan(acc).any(axis=1)
                if redo.any():
                    acc[redo] = gi.lookup(values, self._strides, ok, prep(redo, *mode))
            acc[np.isnan(acc)] = np.inf
            out.update({k: acc[:, i].reshape(out_shape) for i, k in enumerate(names)})
        return {k: out[k] for k in self._names}

    def __call__(self, *coords) -> Dict[str, np.ndarray]:
        coords = np.broadcast_arrays(*[np.asarray(c, dtype=np.float64) for c in coords])
        out_shape = coords[0].shape
        flat = [c.ravel() for c in coords]
        if self.curved:
            return self._curved_call(flat, out_shape)
        n = flat[0].size
        outside = np.zeros(n, dtype=bool)
        lo_idx, frac = [], []
        for ax, x in zip(self.axes, flat):
            outside |= x > ax[-1]
            x = np.clip(x, ax[0], ax[-1])
            if len(ax) == 1:
                lo_idx.append(np.zeros(n, dtype=np.int64))
                frac.append(np.zeros(n))
                continue
            i = np.clip(np.searchsorted(ax, x, side="right") - 1, 0, len(ax) - 2)
            lo_idx.append(i)
            frac.append((x - ax[i]) / (ax[i + 1] - ax[i]))
        d = len(self.axes)
        acc = np.zeros((n, len(self._names)))
        for corner in range(1 << d):
            w = np.ones(n)
            lin = np.zeros(n, dtype=np.int64)
            for a in range(d):
                up = (corner >> a) & 1
                if up and len(self.axes[a]) == 1:
                    w = w * 0.0
                    up = 0
                elif up:
                    w = w * frac[a]
                else:
                    w = w * (1.0 - frac[a])
                lin += np.minimum(lo_idx[a] + up, len(self.axes[a]) - 1) * self._strides[a]
            vals = self._flat[lin]
            # A zero-weight corner must not turn the result into NaN.
            acc += np.where((w > 0)[:, None], vals * w[:, None], 0.0)
        acc[np.isnan(acc).any(axis=1) | outside] = np.inf
        return {k: acc[:, i].reshape(out_shape) for i, k in enumerate(self._names)}


@dataclass
class Profile:
    tp: int
    recompute: str
    model_state_mb: Dict[str, float]
    components: Dict[str, Grid]


class CostModel:
    """A loaded cost-model file. Query it with `layer`, `postprocess` and `param_mb`."""

    def __init__(self, name: str, model: dict, profiles: Iterable[Profile], meta: dict | None = None):
        self.name = name
        self.model = dict(model)
        self.meta = dict(meta or {})
        self.attention_splits = {}  # (tp, recompute, component, quantity) -> stored split dict
        self._profiles = {}
        for p in profiles:
            if p.recompute not in RECOMPUTE_LEVELS:
                raise CostModelError(f"recompute must be one of {RECOMPUTE_LEVELS}, got {p.recompute!r}")
            self._profiles[(p.tp, p.recompute)] = p
            for comp, grid in p.components.items():  # every axis after the micro-batch size is a length
                grid.set_curved(range(1, len(grid.axes)), quadratic_axes=S2_AXES[comp])

    @property
    def kind(self) -> str:
        return self.model.get("kind", "gpt")

    def tps(self) -> list:
        return sorted({tp for tp, _ in self._profiles})

    def require_tp(self, tp: int) -> None:
        """A planner at TP `tp` needs profiles of it (else its first lookup fails deep inside)."""
        if not self.levels(tp):
            raise ValueError(f"cost model {self.name!r} has no profile for tensor-parallel size {tp} (it has TP "
                             f"{self.tps()}): profile this TP (experiment_scripts/gen_cost_model.sh) or run with one "
                             "it has")

    def has(self, tp: int, recompute: str) -> bool:
        return (tp, recompute) in self._profiles

    def profile(self, tp: int, recompute: str) -> Profile:
        try:
            return self._profiles[(tp, recompute)]
        except KeyError:
            have = sorted(self._profiles)
            raise CostModelError(
                f"cost model {self.name!r} has no profile for tp={tp}, recompute={recompute!r}; it has {have}"
            ) from None

    def _grid(self, tp, recompute, component) -> Grid:
        p = self.profile(tp, recompute)
        if component not in p.components:
            raise CostModelError(
                f"cost model {self.name!r} (tp={tp}, {recompute}) has no component {component!r}; "
                f"it has {sorted(p.components)}"
            )
        return p.components[component]

    def layer(self, component, tp, recompute, mbs, seq, dec_seq=None) -> Dict[str, np.ndarray]:
        """Per-layer costs, vectorised over numpy-broadcastable `mbs`/`seq`(/`dec_seq`)."""
        grid = self._grid(tp, recompute, component)
        if component == "decoder":
            if dec_seq is None:
                raise CostModelError("decoder layer costs need dec_seq")
            return grid(mbs, seq, dec_seq)
        return grid(mbs, seq)

    def postprocess(self, tp, recompute, mbs, seq) -> Dict[str, np.ndarray]:
        """Output head + loss; `seq` is the length the head runs on (T5: decoder length)."""
        return self._grid(tp, recompute, "postprocess")(mbs, seq)

    def preprocess(self, tp, recompute, mbs, seq) -> Dict[str, np.ndarray]:
        """Embedding (word + position, dropout) on `seq` tokens; only files that profiled it."""
        return self._grid(tp, recompute, "preprocess")(mbs, seq)

    @property
    def calibration(self):
        """The host calibration stored with this table (`planner.calibration`), else identity."""
        from megatron.planner.cost.calibration import HostCalibration
        try:
            return HostCalibration.from_dict(self.meta.get("calibration"), f"cost model {self.name!r}")
        except ValueError as e:
            raise CostModelError(str(e)) from None

    def param_mb(self, component: str, tp: int) -> float:
        """16-bit parameter memory of one layer (or of the embedding), MB."""
        p = self._profiles.get((tp, "none")) or self.profile(tp, self.levels(tp)[0])
        try:
            return float(p.model_state_mb[component])
        except KeyError:
            raise CostModelError(f"cost model {self.name!r} has no parameter size for {component!r}") from None

    def levels(self, tp: int) -> list:
        return [r for r in RECOMPUTE_LEVELS if (tp, r) in self._profiles]

    # ---- file format -------------------------------------------------------------------
    @classmethod
    def load(cls, path) -> "CostModel":
        path = Path(path)
        try:
            doc = checks.parse(path.read_text())
        except FileNotFoundError:
            raise CostModelError(f"cost model file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise CostModelError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CostModelError(f"{path}: cannot read it as a cost model ({str(e)[:200]})") from None
        try:
            return cls.from_dict(doc)
        except CostModelError as e:
            raise CostModelError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, doc: dict) -> "CostModel":
        problem = checks.document_problem(doc, COMPONENT_AXES, RECOMPUTE_LEVELS, QUANTITIES, FORMAT_NAME, READ_VERSIONS)
        if problem:
            raise CostModelError(problem)
        profiles, splits = [], {}
        for i, p in enumerate(doc.get("profiles", [])):
            comps = {}
            for comp, g in p["components"].items():
                if comp not in COMPONENT_AXES:
                    raise CostModelError(f"profile {i}: unknown component {comp!r}")
                axes_names = COMPONENT_AXES[comp]
                if tuple(g["axes"]) != axes_names:
                    raise CostModelError(f"profile {i} {comp}: axes must be {axes_names}, got {g['axes']}")
                vals = {q: np.array(g[q], dtype=object) for q in QUANTITIES if q in g}
                if "forward_ms" not in vals or "backward_ms" not in vals:
                    raise CostModelError(f"profile {i} {comp}: forward_ms and backward_ms are required")
                vals = {q: np.where(v == None, np.nan, v).astype(np.float64) for q, v in vals.items()}  # noqa: E711
                comps[comp] = Grid([g[a] for a in axes_names], vals)
                for q, sp in (g.get("attention_split") or {}).items():  # measured split (optional)
                    splits[(int(p["tp"]), p["recompute"], comp, q)] = sp
            profiles.append(Profile(int(p["tp"]), p["recompute"], dict(p["model_state_mb"]), comps))
        meta = {k: v for k, v in doc.items() if k not in ("profiles", "model", "name")}
        cm = cls(doc.get("name", "unnamed"), doc.get("model", {}), profiles, meta)
        cm.attention_splits = splits
        return cm

    def to_dict(self) -> dict:
        profiles = []
        for (tp, rc), p in sorted(self._profiles.items()):
            comps = {}
            for comp, grid in p.components.items():
                g = {"axes": list(COMPONENT_AXES[comp])}
                for name, ax in zip(COMPONENT_AXES[comp], grid.axes):
                    g[name] = [int(x) if float(x).is_integer() else float(x) for x in ax]
                for q, v in grid.values.items():
                    g[q] = _nan_to_none(v)
                split = {q: sp for (t, r, c, q), sp in getattr(self, "attention_splits", {}).items()
                         if (t, r, c) == (tp, rc, comp)}
                if split:
                    g["attention_split"] = split
                comps[comp] = g
            profiles.append({"tp": tp, "recompute": rc, "model_state_mb": p.model_state_mb, "components": comps})
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "name": self.name, "model": self.model}
        doc.update({k: v for k, v in self.meta.items() if k not in ("format", "version")})
        doc["profiles"] = profiles
        return doc

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")


def _nan_to_none(a: np.ndarray):
    if a.ndim == 0:
        return None if np.isnan(a) else round(float(a), 4)
    return [_nan_to_none(x) for x in a]
