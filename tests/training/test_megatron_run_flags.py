"""Megatron-LM run flags that have an effect here (megatron/cli/arguments_megatron.py): the
growing global batch against Megatron-LM's own calculator, sample-based length, parameter norm
against the saved weights, gradient zero count, TensorBoard interval, manual GC, the wall-clock
exit, and the one line for a missing wandb."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.config.batch_schedule import BatchSchedule, parse_step_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
        "--mock-data", "--vocab-size", "100", "--micro-batch-size", "1", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def _run(tmp, *argv):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MEGATRON_NO_FUSED_KERNELS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *argv], env=env,
                         capture_output=True, text=True, timeout=300, cwd=str(tmp))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _field(stdout, name):
    return [float(m) for m in re.findall(rf"{name}: *([0-9.eE+-]+) \|", stdout)]


_MEGATRON_RAMP = """
import json, sys
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator as R
out = []
for start, incr, samples, gbs, mbs, dp, iters in json.loads(sys.argv[1]):
    c = R(gbs, mbs, dp, False, 0, start, incr, samples)
    consumed, sizes = 0, []
    for _ in range(iters):
        c.update(consumed, True)
        sizes.append(c.get_current_global_batch_size())
        consumed += sizes[-1]
    out.append(sizes)
print(json.dumps(out))
"""
RAMPS = [(1, 1, 6, 4, 1, 1, 40), (4, 4, 100, 32, 2, 2, 40), (16, 16, 5859, 1536, 1, 8, 200)]


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PYTHONPATH"),
                    reason="set MEGATRON_LM_PYTHONPATH to a Megatron-LM core_v0.9.0 checkout to compare "
                           "--rampup-batch-size with its own calculator")
def test_rampup_batch_sizes_are_megatrons(tmp_path):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator, run as Megatron runs it (its update
    with the consumed samples before each iteration), gives the same batch sizes."""
    env = dict(os.environ, PYTHONPATH=os.environ["MEGATRON_LM_PYTHONPATH"])
    out = subprocess.run([sys.executable, "-c", _MEGATRON_RAMP, json.dumps(RAMPS)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path))  # cwd: not this project's `megatron`
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    for (start, incr, samples, gbs, _, _, iters), want in zip(RAMPS, theirs):
        schedule, consumed, ours = BatchSchedule(gbs, (start, incr, samples)), 0, []
        for _ in range(iters):
            ours.append(schedule.at(consumed))
            consumed += ours[-1]
        assert ours == want and len(set(ours)) > 1


def test_step_schedule_thresholds_are_tokens():
    # '0:16 2.4B:320' at sequence length 2048: 320 from sample 2.4e9 / 2048 on
    steps = parse_step_schedule("0:16 2.4B:320 4.8B:624", 2048)
    assert steps == [(0, 16), (1171875, 320), (2343750, 624)]
    s = BatchSchedule(624, steps=steps)
    assert (s.at(0), s.at(1171874), s.at(1171875), s.at(10 ** 9)) == (16, 16, 320, 624)


def test_logging_extras_and_sample_based_length(tmp_path):
    """--train-samples 7 of 2 is 3 iterations (Megatron drops the partial batch); the logged
    parameter norm is the saved weights' norm; zeros include the padded vocabulary rows, which
    never get a gradient; TensorBoard gets the scalars every 2nd iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    out = _run(tmp_path, "--global-batch-size", "2", "--train-samples", "7", "--log-params-norm",
               "--log-num-zeros-in-grad", "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2",
               "--manual-gc", "--manual-gc-interval", "1", "--wandb-project", "p", "--save", str(save))
    assert "note: --train-samples 7: 3 iterations of 2 samples" in out.stdout
    assert " iteration        3/       3 |" in out.stdout
    norms, zeros = _field(out.stdout, "params norm"), _field(out.stdout, "num zeros")
    assert len(norms) == len(zeros) == 3
    state = torch.load(save / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    weights = [t.double() for sd in state["model"].values() for t in sd.values() if t.is_floating_point()]
    assert abs(norms[-1] - float(torch.stack([w.pow(2).sum() for w in weights]).sum().sqrt())) < 2e-3
    assert min(zeros) >= (128 - 100) * 32  # padded rows of the tied embedding
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("lm loss")] == [2] and [e.step for e in acc.Scalars("params-norm")] == [2]
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert sum("wandb is not installed" in line for line in out.stderr.splitlines()) == 1


def test_exit_duration_saves_and_stops(tmp_path):
    out = _run(tmp_path, "--global-batch-size", "1", "--train-iters", "50", "--exit-duration-in-mins", "1e-6",
               "--save", str(tmp_path / "ckpt"), "--save-interval", "100")
    assert "exiting at iteration 1 after 1e-06 minutes of training (--exit-duration-in-mins)" in out.stdout
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "1"


def test_rampup_run_consumes_the_ramp(tmp_path):
    out = _run(tmp_path, "--global-batch-size", "4", "--rampup-batch-size", "1", "1", "6", "--train-iters", "6")
    assert [int(x) for x in _field(out.stdout, "global batch size")] == [1, 1, 2, 3, 4, 4]
    assert "Megatron-LM core_v0.9.0 refuses this pair" in out.stdout
