"""The newcomer mistakes of issue 49, each one line at start-up that names the flag or key and
the fix: a malformed --split, evaluation asked for with no validation share, --load given the run
folder instead of its checkpoints/ child, T5 with --terapipe, a misspelt key in a JSON config;
the schedule named in the first log lines."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.cli.arguments import parse_args
from megatron.cli.startup_checks import check_inputs
from megatron.config.core import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2"]
DATA = ["--data-path", "some/prefix", "--vocab-size", "64"]  # the flag checks run before any file is read


def _one_line(argv, capsys, model="gpt"):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, model_type=model, world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


def test_malformed_split_is_one_line_before_the_model(capsys):
    line = _one_line(MODEL + DATA + ["--split", "abc"], capsys)
    assert line == "pretrain_gpt.py: error: --split 'abc': expected comma-separated numbers such as 949,50,1"


def test_evaluation_without_a_validation_share_is_refused(capsys):
    line = _one_line(MODEL + DATA + ["--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "1"], capsys)
    assert "--eval-interval 1 and --eval-iters 2 ask for evaluation" in line and "--split 100,0,0" in line
    assert "--split 949,50,1" in line
    # evaluation left at its defaults asks for nothing, and --eval-iters 0 turns it off: both run
    parse_args(MODEL + DATA + ["--split", "100,0,0"], world_size=1)
    parse_args(MODEL + DATA + ["--split", "100,0,0", "--eval-iters", "0"], world_size=1)


def test_t5_terapipe_is_refused_before_asking_for_a_latency_model(capsys):
    t5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
          "2", "--kv-channels", "16", "--encoder-seq-length", "16", "--decoder-seq-length", "8", "--micro-batch-size",
          "2", "--global-batch-size", "2", "--train-iters", "2", "--mock-data", "--vocab-size", "64",
          "--vocab-extra-ids", "4", "--terapipe"]
    line = _one_line(t5, capsys, model="t5")
    assert line.startswith("pretrain_t5.py: error: --terapipe slices the tokens of a causal decoder (GPT)")
    assert "cost-model" not in line


def test_load_of_a_run_folder_names_its_checkpoints_child(tmp_path):
    run = tmp_path / "demo-1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("60\n")
    cfg = parse_args(MODEL + ["--mock-data", "--vocab-size", "64", "--load", str(run)], world_size=1)
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    assert str(e.value) == (f"--load {run}: no checkpoint there (latest_checkpointed_iteration.txt missing), "
                            f"but {run}/checkpoints holds one: --load {run}/checkpoints")
    # an empty --load folder still means "start from scratch" (Megatron's --load == --save habit)
    shutil.rmtree(run / "checkpoints")
    check_inputs(parse_args(MODEL + ["--mock-data", "--vocab-size", "64", "--load", str(run)], world_size=1))


def test_misspelt_aceso_key_names_the_nearest_valid_one(tmp_path):
    doc = json.loads((ROOT / "examples" / "aceso" / "gpt_1.3b_4gpu_3stages.json").read_text())
    doc["num_gpu"] = doc.pop("num_gpus")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(doc))
    from megatron.aceso.config import load_plan
    with pytest.raises(ValueError) as e:
        load_plan(str(path))
    assert str(e.value) == f"{path}: aceso config: unknown key 'num_gpu' (did you mean 'num_gpus'?)"


def test_misspelt_experiment_grid_key_is_refused(tmp_path):
    from megatron.experiments.config import ExperimentConfigError, load_grid
    doc = json.loads((ROOT / "experiment_configs" / "cpu_live_smoke.json").read_text())
    doc["grid"]["micro_batch_size"] = doc["grid"].pop("micro_batch_sizes")
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ExperimentConfigError) as e:
        load_grid(path)
    assert "grid: unknown key 'micro_batch_size' (did you mean 'micro_batch_sizes'?)" in str(e.value)


def test_entry_point_split_error_has_no_traceback():
    """Through the real entry point: one stderr line (before, a 30-line traceback after the model
    was built)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MEGATRON_NO_FUSED_KERNELS="1")
    argv = [sys.executable, "pretrain_gpt.py", *MODEL, *DATA, "--split", "abc"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --split 'abc': expected comma-separated numbers such as 949,50,1"]


@pytest.mark.parametrize("flags,pp,words", [
    ([], 1, "no pipeline (PP=1)"),
    (["--pipeline-model-parallel-size", "2"], 2, "1F1B over 2 stages"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"], 2, "zero bubble ZB-V"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "interleaved 1F1B (1 layers per virtual stage) over 2 stages"),
])
def test_the_schedule_is_named(flags, pp, words):
    """pretrain.py prints this right after the layout line (`> pipeline schedule: ...`)."""
    from megatron.config.schedules import schedule_description
    argv = ["--num-layers", "4", *MODEL[2:], "--mock-data", "--vocab-size", "64", *flags]
    assert words in schedule_description(parse_args(argv, world_size=pp), pp)


def test_the_one_line_ends_torchruns_failure_summary(tmp_path, monkeypatch, capsys):
    """Under torchrun every worker has a reply file (TORCHELASTIC_ERROR_FILE); the line goes
    there, and torchrun's own reader of it (ProcessFailure, which formats its summary box) shows
    it as the failure's last line instead of a link to its docs."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    reply = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(reply))
    line = _one_line(MODEL + DATA + ["--split", "abc"], capsys)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(reply))
    box = ChildFailedError("pretrain_gpt.py", {0: failure}).format_msg().strip().splitlines()
    assert box[-2].strip() == f"traceback : {line}" and set(box[-1]) == {"="}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "flag.json"))  # argparse's own errors too
    with pytest.raises(SystemExit):
        parse_args(MODEL + DATA + ["--global-batch-szie", "8"], model_type="gpt", world_size=1)
    flag = ChildFailedError("pretrain_gpt.py", {0: ProcessFailure(0, 1, 2, str(tmp_path / "flag.json"))})
    assert "did you mean --global-batch-size?" in flag.format_msg().strip().splitlines()[-2]
