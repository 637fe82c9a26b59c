"""Skipped iterations are counted per log interval, NaN prints as NaN, and endless overflow stops."""
import math

import pytest

from megatron.training.logging import MetricsLogger
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config


def _overflowing(rank, world):
    cfg = tiny_config(world=world, fp16=True, iters=20)
    cfg.training.loss_scale = 1e38  # a static scale that overflows fp16 gradients on every step
    cfg.training.max_consecutive_skipped_iters = 3
    t = make_trainer(cfg)
    with pytest.raises(RuntimeError) as e:
        t.train()
    return str(e.value), t.iteration, t.skipped_iters


def test_static_loss_scale_overflow_stops_with_clear_error():
    ((msg, iteration, skipped),) = run_distributed(_overflowing, 1)
    assert "3 consecutive iterations skipped" in msg and "--loss-scale" in msg
    assert skipped == 3 and iteration == 2  # the third skip raises before its iteration is counted


class _PS:
    rank, world_size = 0, 1


def test_logger_prints_nan_and_per_interval_skips(capsys):
    cfg = tiny_config()
    cfg.logging.log_interval = 2
    log = MetricsLogger(cfg, _PS(), flops_per_sample=0.0)
    base = {"grad_norm": None, "tokens": 16.0, "time_s": 0.01, "num_samples": 8}
    log.record(1, 8, dict(base, loss=float("nan")), 1e-3, 1.0, 1)  # first iteration always prints
    log.record(2, 16, dict(base, loss=float("nan")), 1e-3, 1.0, 2)
    log.record(3, 24, dict(base, loss=2.0, grad_norm=1.0), 1e-3, 1.0, 2)
    log.record(4, 32, dict(base, loss=4.0, grad_norm=1.0), 1e-3, 1.0, 2)
    lines = [l for l in capsys.readouterr().out.splitlines() if "iteration" in l]
    assert len(lines) == 3
    assert "lm loss: NAN |" in lines[0] and "grad norm: skipped" in lines[0]
    assert "number of skipped iterations:   1" in lines[0]
    assert "number of skipped iterations:   1" in lines[1]  # per interval, not the running total (2)
    assert "lm loss: 3.000000E+00" in lines[2] and "number of skipped iterations:   0" in lines[2]
    assert log.consumed_tokens == 64
