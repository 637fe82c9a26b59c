"""Who prints what when a run fails (README, Reliability): rank 0 the full report, every other
rank one short line; a checkpoint error is not prefixed with the rank twice."""
import os
import subprocess
import sys
from pathlib import Path

from megatron.training.pretrain import report_failure

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "64", "--lr", "1e-3",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--ckpt-format", "torch_dist"]


class _PS:
    def __init__(self, rank):
        self.rank = rank

    def describe(self):
        return f"rank {self.rank} (tp 0/1, pp {self.rank}/2, dp 0/1)"


def test_rank_zero_reports_in_full_the_others_in_one_line(capsys):
    try:
        {}["missing"]
    except KeyError as e:
        import traceback
        report_failure(_PS(0), "training failed", f"KeyError: {e}", traceback.format_exc(), e)
        report_failure(_PS(1), "training failed", f"KeyError: {e}", traceback.format_exc(), e)
    zero, one = capsys.readouterr().err.split("rank 1 (")
    assert zero.startswith("rank 0 (tp 0/1, pp 0/2, dp 0/1): training failed:\nTraceback") and "KeyError" in zero
    assert one.count("\n") == 1 and "KeyError: 'missing' (at tests/training/test_error_reports.py:" in one
    assert one.endswith("rank 0 reports the job's failure\n")
    report_failure(_PS(0), "checkpoint error", "rank 0 (tp 0/1, pp 0/2, dp 0/1): no checkpoint verifies")
    assert capsys.readouterr().err == "rank 0 (tp 0/1, pp 0/2, dp 0/1): checkpoint error: no checkpoint verifies\n"


def _torchrun(args, timeout=400):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_corrupt_torch_dist_shard_is_reported_once_by_rank_zero(tmp_path):
    """What the user types: save a torch_dist checkpoint, damage a shard, --load it."""
    ckpt = tmp_path / "ckpt"
    r = _torchrun(["--train-iters", "1", "--save", str(ckpt)])
    assert r.returncode == 0, r.stderr[-2000:]
    shard = sorted((ckpt / "iter_0000001").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = _torchrun(["--train-iters", "2", "--load", str(ckpt)])
    assert r.returncode != 0
    errors = [x for x in r.stderr.splitlines() if x.startswith("rank ") and ": checkpoint error: " in x]
    assert len(errors) == 2, r.stderr[-3000:]
    # torchrun's failure summary ends with the first failed rank's line (cli/parser.py tell_torchrun)
    last = [x for x in r.stderr.strip().splitlines() if set(x.strip()) != {"="}][-1].strip()
    assert last.startswith("traceback : rank ") and ": checkpoint error: " in last, last
    zero, = [x for x in errors if x.startswith("rank 0 (")]
    other, = [x for x in errors if x.startswith("rank 1 (")]
    assert zero.count("rank 0 (") == 1 and "verifies" in zero, zero  # not "rank 0 (...): ...: rank 0 (...)"
    assert other.count("rank 1 (") == 1 and other.endswith("rank 0 reports the job's failure"), other
    # torchrun's own traceback follows (and may live under ROOT, in .venv); none of the trainer's
    assert f'File "{ROOT / "megatron"}' not in r.stderr and f'File "{ROOT / "pretrain_gpt.py"}' not in r.stderr
