"""Lookup of a cost-model grid along sequence axes in a basis that knows attention's s^2 term.

A layer's activation memory at a fixed micro-batch size is ``c0 + a*s + c*s^2`` (attention
scores and their softmax grow with the square of the length), so linear interpolation between
profiled lengths is high by up to 10 % (issue 30: 77.5 MB predicted at 768 tokens on a
512/1024 grid where 71.2 MB is kept). Here, along every sequence axis:

* memory (``*_mb``) between grid points: a blend of the two quadratics through the three
  points around the interval (left and right stencils, weighted by the position in the
  interval, so the result is continuous); exact for any quadratic, and equal to the grid on
  grid points. Times stay linear (they are noisy on a shared CPU; a quadratic amplifies noise).
  Where the right stencil touches an unmeasured (null) point, the left one alone is used, and
  where that does too, the plain linear answer.
* past the largest length: the quadratic through the last three points, for every quantity,
  but only on grid lines where that fit predicts the last point from the three before it
  within `HELDOUT_TOLERANCE` (needs >= 4 points), grows at the last point, and not past
  `EXTRAPOLATE_FACTOR` times the largest length. Elsewhere the shape stays infeasible.

The micro-batch axis stays linear (memory is exactly linear in it) and is never extrapolated.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

HELDOUT_TOLERANCE = 0.02
EXTRAPOLATE_FACTOR = 2.0


def _lagrange(ax: np.ndarray, j: np.ndarray, x: np.ndarray) -> Tuple[np.ndarray, ...]:
    x0, x1, x2 = ax[j], ax[j + 1], ax[j + 2]
    return ((x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2)),
            (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2)),
            (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))


def linear_stencil(ax: np.ndarray, x: np.ndarray) -> List[Tuple[np.ndarray, np.ndarray]]:
    """[(index, weight)] of plain linear interpolation; `x` already clipped to the axis."""
    n = len(x)
    if len(ax) == 1:
        return [(np.zeros(n, dtype=np.int64), np.ones(n))]
    i = np.clip(np.searchsorted(ax, x, side="right") - 1, 0, len(ax) - 2)
    frac = (x - ax[i]) / (ax[i + 1] - ax[i])
    return [(i, 1.0 - frac), (i + 1, frac)]


def curved_stencil(ax: np.ndarray, x: np.ndarray, inside_quadratic, left_only: bool = False
                   ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """[(index, weight)] along one sequence axis for raw (unclipped) `x`.

    Inside the grid: quadratic blend if `inside_quadratic`, else linear; `left_only` keeps
    only the left stencil where it exists (used when the right one touches a null point). Past the last point:
    the quadratic through the last three (the caller decides whether that is allowed). Below
    the first point: clamped, as everywhere in the cost model."""
    n_ax, last = len(ax), ax[-1]
    past = x > last
    xc = np.clip(x, ax[0], last)
    any_past = bool(past.any())
    if n_ax < 3 or (not inside_quadratic and not any_past):
        return linear_stencil(ax, xc)
    n = len(x)
    idx = [np.zeros(n, dtype=np.int64) for _ in range(4)]
    w = [np.zeros(n) for _ in range(4)]
    if inside_quadratic:
        i = np.clip(np.searchsorted(ax, xc, side="right") - 1, 0, n_ax - 2)
        frac = (xc - ax[i]) / (ax[i + 1] - ax[i])
        has_a, has_b = i >= 1, i <= n_ax - 3
        alpha = np.where(has_a & has_b, 0.0 if left_only else frac, np.where(has_b, 1.0, 0.0))
        ja, jb = np.clip(i - 1, 0, n_ax - 3), np.clip(i, 0, n_ax - 3)
        la, lb = _lagrange(ax, ja, xc), _lagrange(ax, jb, xc)
        base = i - 1
        for k in range(3):  # stencil A covers base..base+2, B base+1..base+3
            w[k] = w[k] + (1.0 - alpha) * la[k]
            w[k + 1] = w[k + 1] + alpha * lb[k]
        for k in range(4):
            idx[k] = np.clip(base + k, 0, n_ax - 1)
            w[k] = np.where((base + k < 0) | (base + k > n_ax - 1), 0.0, w[k])
    else:
        for k, (ii, ww) in enumerate(linear_stencil(ax, xc)):
            idx[k], w[k] = ii, ww
    if any_past:
        j = np.full(n, n_ax - 3)
        le = _lagrange(ax, j, x)
        for k in range(4):
            idx[k] = np.where(past, np.minimum(n_ax - 3 + k, n_ax - 1), idx[k])
            w[k] = np.where(past, le[k] if k < 3 else 0.0, w[k])
    return list(zip(idx, w))


def extrapolation_ok(values: np.ndarray, ax: np.ndarray, axis: int) -> np.ndarray:
    """Per grid line along `axis`, whether extrapolating past its end is trusted (the held-out
    test in the module docstring); broadcast to the grid's shape."""
    v = np.moveaxis(values, axis, -1)
    ok = np.zeros(v.shape[:-1], dtype=bool)
    if len(ax) >= 4:
        with np.errstate(invalid="ignore", divide="ignore"):
            w = _lagrange(ax, np.array(len(ax) - 4), np.array(ax[-1]))
            pred = w[0] * v[..., -4] + w[1] * v[..., -3] + w[2] * v[..., -2]
            err = np.abs(pred - v[..., -1]) / np.abs(v[..., -1])
            x0, x1, x2 = ax[-3:]
            # slope at the last point of the quadratic through the last three
            y0, y1, y2 = v[..., -3], v[..., -2], v[..., -1]
            d = (y0 * (2 * x2 - x1 - x2) / ((x0 - x1) * (x0 - x2)) + y1 * (2 * x2 - x0 - x2) / ((x1 - x0) * (x1 - x2))
                 + y2 * (2 * x2 - x0 - x1) / ((x2 - x0) * (x2 - x1)))
            curv = y0 / ((x0 - x1) * (x0 - x2)) + y1 / ((x1 - x0) * (x1 - x2)) + y2 / ((x2 - x0) * (x2 - x1))
            # a straight line rounded to the file's 4 decimals may bend down a little
            bend_ok = curv * x2 * x2 >= -0.005 * np.abs(y2)
            ok = (err < HELDOUT_TOLERANCE) & (d >= 0) & bend_ok & np.isfinite(v[..., -4:]).all(-1)
    return np.moveaxis(np.broadcast_to(ok[..., None], v.shape), -1, axis)


def prepare(axes: Sequence[np.ndarray], coords: Sequence[np.ndarray], curved: Sequence[int], quadratic,
            left_only: bool = False):
    """(stencils, outside, past_axes) for `lookup`: per axis [(index, weight)], points with no
    answer, and [(axis, mask of points past its end)]. `quadratic`: the curved axes that
    interpolate in the quadratic basis (empty: all linear inside the grid)."""
    n = coords[0].size
    stencils, outside, past_axes = [], np.zeros(n, dtype=bool), []
    for a, (ax, x) in enumerate(zip(axes, coords)):
        if a in curved:
            past = x > ax[-1]
            outside |= x > EXTRAPOLATE_FACTOR * ax[-1]
            if past.any():
                past_axes.append((a, past))
            stencils.append(curved_stencil(ax, x, bool(quadratic) and a in quadratic, left_only))
        else:
            outside |= x > ax[-1]
            stencils.append(linear_stencil(ax, np.clip(x, ax[0], ax[-1])))
    return stencils, outside, past_axes


def lookup(cols: Sequence[np.ndarray], strides: Sequence[int], ok_cols: dict, prepared) -> np.ndarray:
    """(n, q) values of the quantities `cols` (one flat, C-ordered array each) at the points
    `prepare`d. `ok_cols[a]`: per quantity, the flat extrapolation flags along axis a. inf
    where infeasible."""
    stencils, outside, past_axes = prepared
    n, q = len(outside), len(cols)
    # All stencil corners at once: (corners, n) flat indices and weights, one gather per
    # quantity (1-D gathers are several times faster than gathering rows of a 2-D table).
    lin = np.zeros((1, n), dtype=np.int64)
    w = np.ones((1, n))
    for a, st in enumerate(stencils):
        idx = np.stack([ii for ii, _ in st])  # (k, n)
        wa = np.stack([ww for _, ww in st])
        lin = (lin[:, None, :] + idx[None, :, :] * strides[a]).reshape(-1, n)
        w = (w[:, None, :] * wa[None, :, :]).reshape(-1, n)
    nz = None
    acc = np.empty((n, q))
    for j, col in enumerate(cols):
        vals = col[lin]  # (corners, n)
        if np.isnan(vals).any():  # a zero-weight corner must not turn the result into NaN
            nz = w != 0 if nz is None else nz
            vals = np.where(nz, vals, 0.0)
        acc[:, j] = np.einsum("cn,cn->n", w, vals)
    if past_axes:
        nz = w != 0 if nz is None else nz
        for a, past in past_axes:
            blocked = nz & past
            for j in range(q):
                bad = (blocked & ~ok_cols[a][j][lin]).any(axis=0)
                acc[bad, j] = np.inf
    acc[outside] = np.inf
    return acc
