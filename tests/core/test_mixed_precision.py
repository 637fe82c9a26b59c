"""bf16 autocast tracks fp32; fp16 dynamic loss scaling skips and counts overflowing steps."""
import pytest

from megatron.core.grad_scaler import DynamicGradScaler
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, shards, tiny_config


def _train(rank, world, kw, initial_scale=None):
    cfg = tiny_config(world=world, iters=8, lr=1e-2, **kw)
    if initial_scale is not None:
        cfg.training.initial_loss_scale = initial_scale
    t = make_trainer(cfg)
    before = shards(t)
    hist = t.train()
    return [h["loss"] for h in hist], t.skipped_iters, t.optimizer.loss_scale, before, shards(t), \
        [h["applied"] for h in hist]


def test_bf16_tracks_fp32():
    fp32 = run_distributed(_train, 1, {})[0][0]
    bf16 = run_distributed(_train, 1, dict(bf16=True))[0][0]
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16[-1] < bf16[0] - 0.1


def test_fp16_overflow_skips_and_backs_off():
    losses, skipped, scale, before, after, applied = run_distributed(_train, 2, dict(fp16=True, tp=2),
                                                                     initial_scale=2.0 ** 60)[0]
    assert skipped == applied.count(False) and skipped >= 2
    assert scale < 2.0 ** 60
    if not any(applied):  # every step overflowed: the weights must be untouched
        for name in before:
            assert (before[name][0] == after[name][0]).all(), name


def test_fp16_with_sane_scale_trains():
    losses, skipped, scale, *_ , applied = run_distributed(_train, 1, dict(fp16=True), initial_scale=2.0 ** 10)[0]
    assert skipped == 0 and all(applied)
    assert losses[-1] < losses[0] - 0.1


def test_scaler_hysteresis_and_growth():
    s = DynamicGradScaler(initial_scale=1024, hysteresis=2, growth_interval=3)
    s.update(True)
    assert s.scale == 1024  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024
    static = DynamicGradScaler(initial_scale=8, static=True)
    static.update(True)
    assert static.scale == 8
