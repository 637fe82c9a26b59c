"""What a user sees when --load is wrong: a missing folder is an error (unless it is also
--save), and a checkpoint of another TP/PP layout prints the exact conversion command."""
import os
import shlex
import subprocess
import sys

from megatron.cli.arguments import parse_args
from megatron.checkpointing.torch_format import CheckpointError, load_checkpoint
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config
from tests.cli.test_arguments import BASE
from tests.checkpointing.test_checkpointing import _first_half
from tools.checkpoint import convert


def test_missing_load_folder_exits_2_in_one_line(tmp_path):
    missing = str(tmp_path / "ckpt_typo")
    env = {"WORLD_SIZE": "1", "RANK": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--load", missing], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--load {missing}: no such folder" in r.stderr and "--save" in r.stderr
    # The resume-or-start pattern (same folder for both) is fine.
    cfg = parse_args(BASE + ["--load", missing, "--save", missing], world_size=1)
    assert cfg.checkpoint.load == missing


def _load_error(rank, world, ckpt):
    t = make_trainer(tiny_config(world=world, load=ckpt))
    try:
        load_checkpoint(t)
    except CheckpointError as e:
        return str(e)
    return f"loaded iteration {t.iteration}"


def test_other_layout_prints_the_convert_command_that_works(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_first_half, 2, ckpt, dict(tp=2))
    (msg,) = run_distributed(_load_error, 1, ckpt)
    assert "saved at TP 2 x PP 1, this run is TP 1 x PP 1" in msg and "--ckpt-format torch_dist" in msg, msg
    cmd = msg.split("convert it with: ")[1].split(" (then")[0]
    out = str(tmp_path / "ckpt_tp1_pp1")
    assert cmd == (f"python tools/checkpoint/convert.py --load {ckpt} --save {out} "
                   f"--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1")
    argv = shlex.split(cmd)
    assert argv[:2] == ["python", "tools/checkpoint/convert.py"] and os.path.exists(argv[1])
    assert convert.main(argv[2:]) == 0  # the printed command, run
    (ok,) = run_distributed(_load_error, 1, out)
    assert ok == "loaded iteration 2", ok
