"""The learning rate of every iteration is Megatron's, to the bit: Megatron's own
OptimizerParamScheduler (megatron-core 0.16.1, and Megatron-LM core_v0.9.0's) runs beside
megatron.core.optimizer.LRScheduler over a few hundred iterations: warm-up (by iterations, by
a fraction, by samples), cosine, linear, constant, inverse-square-root, and a decoupled group.

Megatron's package is also named `megatron`, so it runs in its own process (PYTHONPATH):
MEGATRON_CORE_PYTHONPATH (e.g. `pip install --no-deps --target .cache/mcore megatron-core==0.16.1`,
as .ci/run does) and MEGATRON_LM_PYTHONPATH (a core_v0.9.0 checkout); each skips when absent."""
import json
import os
import subprocess
import sys

import pytest

from megatron.config.core import TrainingConfig
from megatron.core.optimizer import LRScheduler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE = os.path.join(ROOT, "tests", "fixtures", "megatron", "lr_schedule_oracle.py")
CASES = [
    dict(style="cosine", lr=3e-4, min_lr=3e-5, warmup_iters=7, decay_iters=250, gbs=8, iters=300),
    dict(style="linear", lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=200, gbs=12, iters=260),
    dict(style="constant", lr=2e-3, min_lr=0.0, warmup_iters=5, decay_iters=100, gbs=4, iters=120),
    dict(style="inverse-square-root", lr=1e-3, min_lr=1e-5, warmup_iters=20, decay_iters=240, gbs=16, iters=300),
    dict(style="inverse-square-root", lr=1e-3, min_lr=0.0, warmup_iters=0, decay_iters=100, gbs=3, iters=130),
    dict(style="cosine", lr=6e-4, min_lr=6e-5, warmup_fraction=0.013, decay_iters=300, gbs=24, iters=320),
    dict(style="cosine", lr=2e-3, min_lr=2e-4, warmup_iters=5, decay_iters=60, gbs=16, iters=80),  # make demo's
    dict(style="linear", lr=1e-3, min_lr=1e-5, warmup_iters=0, decay_iters=150, gbs=8, iters=160),
    # --train-samples: the CLI turns samples into fractional iterations of the global batch
    dict(style="cosine", lr=1e-3, min_lr=1e-4, warmup_samples=100, decay_samples=5000, gbs=24, iters=230),
    # --decoupled-lr / --decoupled-min-lr: the embedding and output layer's own curve
    dict(style="cosine", lr=3e-4, min_lr=3e-5, warmup_iters=9, decay_iters=200, gbs=8, iters=220,
         decoupled=(5e-4, 5e-6)),
]


def _ours(case):
    samples = "decay_samples" in case
    gbs = case["gbs"]
    cfg = TrainingConfig(lr=case["lr"], min_lr=case["min_lr"], lr_decay_style=case["style"], global_batch_size=gbs,
                         train_iters=case["iters"],
                         lr_decay_iters=case["decay_samples"] / gbs if samples else case["decay_iters"],
                         lr_warmup_iters=case["warmup_samples"] / gbs if samples else case.get("warmup_iters", 0),
                         lr_warmup_fraction=case.get("warmup_fraction"))
    s = LRScheduler(cfg)
    out = []
    for _ in range(case["iters"]):
        # as MegatronOptimizer.step sets each group's lr, then the trainer steps the scheduler
        row = [s.lr()] + ([s.lr(max_lr=case["decoupled"][0], min_lr=case["decoupled"][1])]
                          if case.get("decoupled") else [])
        out.append(row)
        s.step(1)
    return out


def _megatron(path):
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, ORACLE, json.dumps(CASES)], env=env, capture_output=True, text=True,
                         timeout=600, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _mcore_path():
    path = os.environ.get("MEGATRON_CORE_PYTHONPATH") or os.path.join(ROOT, ".cache", "mcore")
    return path if os.path.isdir(os.path.join(path, "megatron", "core")) else None


@pytest.mark.parametrize("which", ["megatron-core", "core_v0.9.0"])
def test_every_iteration_has_megatrons_learning_rate(which):
    path = _mcore_path() if which == "megatron-core" else os.environ.get("MEGATRON_LM_PYTHONPATH")
    if not path:
        pytest.skip("set MEGATRON_CORE_PYTHONPATH (megatron-core 0.16.1) / MEGATRON_LM_PYTHONPATH (Megatron-LM "
                    "core_v0.9.0 checkout) to run Megatron's scheduler beside ours")
    want = _megatron(path)
    for case, theirs in zip(CASES, want):
        ours = _ours(case)
        assert len(ours) == len(theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert a == b, f"{case}: iteration {i + 1}: ours {a}, Megatron's {b}"


def test_warm_up_starts_from_zero_as_megatron():
    """Megatron's first iteration trains with lr 0 (its scheduler steps after the optimizer and
    warms up as max_lr * steps / warm-up steps); the peak is reached at iteration W + 1."""
    s = LRScheduler(TrainingConfig(lr=1.0, lr_warmup_iters=4, global_batch_size=8, train_iters=10))
    got = []
    for _ in range(6):
        got.append(s.lr())
        s.step(1)
    assert got[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and got[5] < 1.0
