"""TeraPipe's latency model never predicts a negative or non-monotone time: the context term is
fitted by exact non-negative least squares, a profiled t(b, l, 0) table is made monotone, and a
file that still predicts such times is refused in one line naming it (before any process group).
The shipped CPU model is sound, and the drift warning of a TeraPipe run names TeraPipe's profiler."""
import io
import itertools
import json
import os
import sys
from contextlib import redirect_stderr

import numpy as np
import pytest

from megatron.planner.terapipe.latency import SliceLatencyModel, fit_context, monotone_table, nnls

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHIPPED = os.path.join(ROOT, "cost_models", "terapipe_cpu_tiny_gpt.json")


def _kkt_ok(A, y, x, tol=1e-9):
    """x >= 0; the gradient is zero on the support and non-negative off it (NNLS optimality)."""
    g = A.T @ (A @ x - y)
    scale = tol * max(1.0, float(np.abs(A.T @ y).max()))
    return bool(np.all(x >= 0) and np.all(np.abs(g[x > 0]) <= scale) and np.all(g[x == 0] >= -scale))


@pytest.mark.parametrize("seed", range(8))
def test_nnls_satisfies_the_optimality_conditions(seed):
    rng = np.random.default_rng(seed)
    A = rng.uniform(0, 1, (20, 3))
    y = A @ rng.normal(0, 1, 3) + rng.normal(0, 0.1, 20)  # true coefficients of either sign
    x = nnls(A, y)
    assert _kkt_ok(A, y, x)
    # no feasible point on a coarse grid beats it
    best = min(np.sum((A @ np.array(p) - y) ** 2) for p in itertools.product(np.linspace(0, 3, 13), repeat=3))
    assert np.sum((A @ x - y) ** 2) <= best + 1e-12


def test_noisy_context_timings_give_non_negative_coefficients():
    """Timings whose unconstrained fit has a negative coefficient (as the old shipped model had)."""
    rng = np.random.default_rng(3)
    pts = [(b, l, c, 0.04 * b * c - 0.02 * b * l + rng.normal(0, 0.5))
           for b in (1, 2, 4) for l in (8, 16, 32, 64) for c in (16, 32, 64)]
    X = np.array([[b * l, b * c, b * l * c] for b, l, c, _ in pts])
    assert np.linalg.lstsq(X, np.array([p[3] for p in pts]), rcond=None)[0].min() < 0
    coef = fit_context(pts)
    assert min(coef) >= 0 and coef[1] > 0


def test_monotone_table_is_the_running_maximum():
    t = monotone_table([[3.0, 2.0, 5.0], [1.0, 4.0, 4.5]])
    np.testing.assert_array_equal(t, [[3.0, 3.0, 5.0], [3.0, 4.0, 5.0]])


OLD_SHIPPED = {"format": "megatron-terapipe-latency", "version": 1, "hidden_size": 64, "mbs": [1.0, 2.0],
               "seq": [8.0, 16.0], "t0_ms": [[14.9, 14.2], [6.5, 8.7]],
               "context_coef": [-0.0235, 0.0387, -0.000116], "p2p_ms_per_mb": 0.0, "p2p_latency_ms": 0.0}


def _pretrain_gpt_args(path):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "128",
            "--pipeline-model-parallel-size", "2", "--terapipe", "--terapipe-slices", "auto",
            "--terapipe-cost-model", str(path)]


def test_unsound_model_is_refused_in_one_line_naming_the_file(tmp_path):
    from megatron.cli.arguments import parse_args
    bad = tmp_path / "lat.json"
    bad.write_text(json.dumps(OLD_SHIPPED))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        parse_args(_pretrain_gpt_args(bad), world_size=2)
    msg = err.getvalue().strip()
    assert e.value.code == 2 and len(msg.splitlines()) == 1, msg
    # SliceLatencyModel.problems() names the first bad corner of the context term
    assert str(bad) in msg and "negative context time" in msg
    assert "python -m megatron.planner.terapipe.latency" in msg
    with pytest.raises(ValueError, match="negative context time"):  # the planner's own reader too
        SliceLatencyModel.load(bad)


def test_shipped_model_is_sound_and_predicts_monotone_positive_times():
    from megatron.cli.arguments import parse_args
    m = SliceLatencyModel.load(SHIPPED)
    assert m.problems() == [] and min(m.coef) >= 0
    b, l, c = np.meshgrid([1, 2, 3, 4], [8, 16, 24, 32, 48, 64], [0, 16, 32, 64, 128], indexing="ij")
    t = m.layer_ms(b, l, c)
    assert np.all(t > 0)
    for ax in range(3):
        assert np.all(np.diff(t, axis=ax) >= 0), ax
    parse_args(_pretrain_gpt_args(SHIPPED), world_size=2)  # the README example's flags accept it


def test_drift_warning_of_a_terapipe_run_names_terapipes_profiler(capsys):
    from megatron.core.parallel_state import ParallelState
    from megatron.training.logging import MetricsLogger
    from tests.parity_utils import tiny_config
    cfg = tiny_config()
    cfg.logging.log_interval = 1
    log = MetricsLogger(cfg, ParallelState(), 1.0)
    out = {"loss": 1.0, "time_s": 1.0, "tokens": 8, "grad_norm": 1.0,
           "planner": {"planner": "terapipe", "num_microbatches": 1, "simulated_ms": 10.0}}
    for it in (1, 2, 3, 4):  # judged on the median of the iterations after the first, 3 at least
        log.record(it, it, out, 1e-3, 1.0, 0)
    err = capsys.readouterr().err
    assert "measured iteration time is 100.0x the planner's simulated time (median of 3 iterations)" in err
    assert "python -m megatron.planner.terapipe.latency" in err and "gen_cost_model.sh" not in err
    assert "megatron.profiling.calibrate --terapipe-cost-model" in err


def test_drift_warning_ignores_one_slow_iteration_and_names_a_busy_host(capsys, monkeypatch):
    """One iteration slowed by another process is not the cost model's fault: the warning is
    judged on the median; when it does fire on a busy host, it says so with the load."""
    import os

    from megatron.core.parallel_state import ParallelState
    from megatron.training.logging import MetricsLogger
    from tests.parity_utils import tiny_config
    cfg = tiny_config()
    cfg.logging.log_interval = 1
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def run(times_ms):
        log = MetricsLogger(cfg, ParallelState(), 1.0)
        for it, ms in enumerate(times_ms, 1):
            out = {"loss": 1.0, "time_s": ms / 1e3, "tokens": 8, "grad_norm": 1.0,
                   "planner": {"planner": "dynapipe", "num_microbatches": 1, "simulated_ms": 10.0}}
            log.record(it, it, out, 1e-3, 1.0, 0)
        return capsys.readouterr().err
    assert "WARNING" not in run([50, 11, 84, 9, 12, 10])  # one 8.4x iteration among 1x ones
    err = run([50, 40, 41, 39, 45])
    assert "4.0x the planner's simulated time (median of 3 iterations)" in err
    assert "the host is busy (load average 9.0 on 2 cores)" in err
