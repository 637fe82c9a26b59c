"""The cost model's lookup along sequence lengths: exact for a + b*s + c*s^2 in memory,
extrapolated past the grid only where a held-out fit allows."""
import numpy as np
import pytest

from megatron.planner.cost.cost_model import Grid
from megatron.planner.cost.grid_interp import EXTRAPOLATE_FACTOR

MBS = np.array([1.0, 2.0, 4.0])
SEQ = np.array([128.0, 256.0, 512.0, 1024.0, 2048.0])


def quad(b, s):
    return b * (3.0 + 0.5 * s + 0.001 * s * s)


def grid(fn=quad, seq=SEQ):
    v = fn(MBS[:, None], seq[None, :])
    g = Grid([MBS, seq], {"forward_ms": v, "backward_ms": v, "stored_mb": v, "peak_mb": v})
    g.set_curved([1])
    return g


def test_memory_is_exact_for_quadratics_between_points_times_stay_linear():
    s = np.array([128, 200, 300, 768, 1500, 2048.0])
    r = grid()(3.0, s)
    np.testing.assert_allclose(r["stored_mb"], quad(3.0, s), rtol=1e-12)
    assert (r["forward_ms"][1:-1] > quad(3.0, s[1:-1])).all()  # linear chords lie above a convex curve
    np.testing.assert_allclose(r["forward_ms"][[0, -1]], quad(3.0, s[[0, -1]]), rtol=1e-12)


def test_continuous_and_monotone_across_grid_points():
    s = np.linspace(128, 2048, 2001)
    m = grid()(2.0, s)["stored_mb"]
    assert (np.diff(m) > 0).all()


def test_extrapolates_where_held_out_fit_holds():
    s = np.array([3000.0, 4096.0, 2048 * EXTRAPOLATE_FACTOR + 1])
    r = grid()(2.0, s)
    np.testing.assert_allclose(r["stored_mb"][:2], quad(2.0, s[:2]), rtol=1e-9)
    np.testing.assert_allclose(r["forward_ms"][:2], quad(2.0, s[:2]), rtol=1e-9)
    assert np.isinf(r["stored_mb"][2])


def test_no_extrapolation_where_the_fit_fails_held_out_points():
    # A cubic term the last three points cannot see: the held-out point is predicted > 2 % off.
    cubic = lambda b, s: b * (1.0 + s + 1e-6 * s ** 3)  # noqa: E731
    r = grid(cubic)(1.0, np.array([2048.0, 3000.0]))
    assert np.isfinite(r["stored_mb"][0]) and np.isinf(r["stored_mb"][1])


def test_three_point_axes_do_not_extrapolate_and_nulls_fall_back_to_linear():
    seq = np.array([128.0, 256.0, 512.0])
    r = grid(seq=seq)(1.0, np.array([600.0]))
    assert np.isinf(r["stored_mb"]).all()
    v = quad(MBS[:, None], SEQ[None, :])
    v[2, 3:] = np.nan  # (4, >= 1024) never measured
    g = Grid([MBS, SEQ], {"forward_ms": v, "backward_ms": v, "stored_mb": v, "peak_mb": v})
    g.set_curved([1])
    r = g(np.array([4.0, 4.0, 4.0, 3.0]), np.array([384.0, 700.0, 2048.0, 450.0]))
    assert r["stored_mb"][0] == pytest.approx(quad(4.0, 384.0), rel=1e-12)  # the left stencil is clear of nulls
    assert np.isinf(r["stored_mb"][1:3]).all()  # an interval with a null end is infeasible
    # mbs 3 blends rows 2 and 4: row 4's right stencil is null, row 2's is not; left-only is exact
    assert r["stored_mb"][3] == pytest.approx(quad(3.0, 450.0), rel=1e-12)


def test_uncurved_grid_is_plain_multilinear():
    v = quad(MBS[:, None], SEQ[None, :])
    g = Grid([MBS, SEQ], {"stored_mb": v})
    r = g(1.0, np.array([192.0, 4096.0]))["stored_mb"]
    assert r[0] == pytest.approx((quad(1, 128.0) + quad(1, 256.0)) / 2) and np.isinf(r[1])
