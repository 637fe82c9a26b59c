"""Inconsistent flags exit with status 2 and one line naming the flags, before any process group."""
import subprocess
import sys

import pytest

from megatron.cli.arguments import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "100"]


def _error(capsys, argv, world=4):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("extra,world,needles", [
    (["--num-attention-heads", "5"], 1, ["--hidden-size (64)", "--num-attention-heads (5)"]),
    (["--tensor-model-parallel-size", "3"], 4, ["world size (4)", "--tensor-model-parallel-size (3)"]),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"], 4, ["world size (4)", "= 8"]),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], 2, ["--global-batch-size (8)", "--micro-batch-size (3)"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--num-layers (4)", "--pipeline-model-parallel-size (3)"]),
    (["--bf16", "--fp16"], 1, ["--bf16 and --fp16"]),
    (["--min-lr", "1", "--lr", "0.1"], 1, ["--min-lr (1.0)", "--lr (0.1)"]),
    (["--pipeline-stage-layers", "1,2", "--pipeline-model-parallel-size", "2"], 2, ["--pipeline-stage-layers 1,2"]),
    (["--recompute-method", "uniform"], 1, ["--recompute-method", "--recompute-granularity full"]),
])
def test_inconsistent_flags(capsys, extra, world, needles):
    err = _error(capsys, BASE + extra, world)
    for n in needles:
        assert n in err, err


def test_missing_required_and_data(capsys):
    assert "--num-layers" in _error(capsys, ["--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
                                             "--mock-data", "--vocab-size", "10"], 1)
    no_data = [a for a in BASE if a not in ("--mock-data",)]
    assert "--data-path" in _error(capsys, no_data, 1)


def test_valid_config_maps_flags():
    cfg = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size",
                             "8", "--lr", "3e-4", "--recompute-granularity", "selective", "--bf16"], world_size=4)
    assert cfg.parallel.data_parallel_size == 2 and cfg.num_microbatches == 2
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.kv_channels == 16
    assert cfg.training.recompute_level == "selective" and cfg.training.params_dtype_name == "bfloat16"
    assert cfg.model.padded_vocab_size(2) == 256


def test_entry_point_exits_before_process_group():
    # WORLD_SIZE=4 with TP=3: must fail fast with the message, without waiting for peers.
    env = {"WORLD_SIZE": "4", "RANK": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--tensor-model-parallel-size", "3"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert "world size (4) is not divisible by --tensor-model-parallel-size (3)" in r.stderr


MT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
      "--data-path", "in", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.mark.parametrize("extra,needle", [
    (["--dynapipe", "--tokens-per-global-batch", "512", "--dynapipe-cost-model", "c.json"], "--targets-data-path"),
    (["--targets-data-path", "out"], "--tokens-per-global-batch"),
    (["--targets-data-path", "out", "--tokens-per-global-batch", "512", "--dynapipe"], "--dynapipe-cost-model"),
    (["--targets-data-path", "out", "--tokens-per-global-batch", "512", "--dynapipe", "--dynapipe-cost-model", "c",
      "--pack-dataset"], "--dynapipe-packed-rows"),
    (["--targets-data-path", "out", "--tokens-per-global-batch", "512", "--dynapipe", "--dynapipe-cost-model", "c",
      "--seq-length", "60"], "multiples of 8"),
    (["--pack-dataset"], "give --targets-data-path"),
])
def test_dynapipe_flags(capsys, extra, needle):
    assert needle in _error(capsys, MT + extra, 1)


def test_planner_log_line():
    from megatron.training.logging import planner_line
    line = planner_line({"planner": "dynapipe", "num_microbatches": [3, 3], "microbatch_shapes": [(4, 64), (2, 128)],
                         "padding_efficiency": 0.975, "recompute": "selective", "schedule": "adaptive",
                         "planning_ms": 12.5, "plan_wait_ms": 0.2, "simulated_ms": 410.0,
                         "predicted_peak_mb": [120.0, 30.5]}, 0.5)
    for part in ("micro-batches per DP group: [3, 3]", "4x64, 2x128", "padding efficiency: 0.975",
                 "recompute: selective", "planning ms: 12.5", "simulated / measured iteration ms: 410.0 / 500.0",
                 "[120.0, 30.5]", "n/a on CPU"):
        assert part in line, line


# -- every size and count flag is checked up front, naming the flag (issue 16) -----------------

@pytest.mark.parametrize("extra,needle", [
    (["--global-batch-size", "-4"], "--global-batch-size must be >= 1, got -4"),
    (["--ffn-hidden-size", "-8"], "--ffn-hidden-size must be positive, got -8"),
    (["--vocab-size", "0"], "--vocab-size must be positive, got 0"),
    (["--kv-channels", "0"], "--kv-channels must be positive"),
    (["--max-position-embeddings", "-1"], "--max-position-embeddings must be positive"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    (["--num-workers", "-2"], "--num-workers must be >= 0"),
    (["--hysteresis", "0"], "--hysteresis must be >= 1"),
    (["--loss-scale", "0"], "--loss-scale must be positive"),
    (["--max-consecutive-skipped-iters", "-1"], "--max-consecutive-skipped-iters must be >= 0"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups (3) must divide"),
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.01"], "rotary dimensions"),
])
def test_bad_sizes_named(capsys, extra, needle):
    err = _error(capsys, BASE + extra, 1)
    assert needle in err, err


def test_unknown_flag_one_line_from_the_first_rank_only(capsys, monkeypatch):
    """Under torchrun the first rank to hit a flag error prints it (whichever it is: torchrun kills
    the others when it exits, rank 0 included, issue 48); the other ranks of the launch stay quiet."""
    import uuid
    err = _error(capsys, BASE + ["--no-such-flag"], 1)
    assert "unrecognized arguments: --no-such-flag" in err and "usage:" not in err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)
    for rank, heard in (("3", True), ("0", False), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            parse_args(BASE + ["--hidden-size", "abc"], world_size=4)
        err = capsys.readouterr().err
        assert e.value.code == 2 and ("--hidden-size" in err) == heard, (rank, err)


def test_unwritable_save_dir_named(capsys, tmp_path, monkeypatch):
    import os
    import megatron.cli.arguments as arguments
    real_access = os.access
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    # root ignores permission bits, so the check's view of the folder is what is simulated
    monkeypatch.setattr(arguments.os, "access", lambda p, m: False if p == locked else real_access(p, m))
    err = _error(capsys, BASE + ["--save", locked + "/ckpt"], 1)
    assert "--save" in err and "not writable" in err and locked in err
    monkeypatch.undo()
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a folder" in _error(capsys, BASE + ["--save", str(f / "ckpt")], 1)


def test_dynapipe_cost_model_for_another_model_is_refused(capsys):
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a100 = os.path.join(root, "cost_models", "gpt_6.7b_a100.json")
    argv = BASE + ["--data-path", "in", "--targets-data-path", "out", "--tokens-per-global-batch", "512",
                   "--dynapipe", "--dynapipe-cost-model", a100]
    err = _error(capsys, argv, 1)
    assert "hidden_size 4096 vs 64" in err and "--dynapipe-cost-model-any" in err
    cfg = parse_args(argv + ["--dynapipe-cost-model-any"], world_size=1)  # deliberate override
    assert cfg.data.dynapipe
    tiny = os.path.join(root, "cost_models", "cpu_tiny_gpt.json")
    ok = BASE + ["--ffn-hidden-size", "256", "--data-path", "in", "--targets-data-path", "out",
                 "--tokens-per-global-batch", "512", "--dynapipe", "--dynapipe-cost-model", tiny]
    assert parse_args(ok, world_size=1).data.dynapipe_cost_model == tiny


# -- older Megatron spellings (issue 15) ----------------------------------------------------------

def test_older_spellings_map_to_todays_meaning():
    cfg = parse_args(BASE + ["--checkpoint-activations", "--data-impl", "mmap", "--DDP-impl", "local",
                             "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                             "--no-bias-dropout-fusion", "--use-mcore-models", "--keep-sequential-samples"],
                     world_size=1)
    t = cfg.training
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "uniform", 1)
    assert parse_args(BASE + ["--recompute-activations"], world_size=1).training.recompute_granularity == "selective"


@pytest.mark.parametrize("extra,needle", [
    (["--data-impl", "lazy"], "only Megatron's mmap"),
    (["--checkpoint-activations", "--recompute-granularity", "selective"], "conflicts"),
])
def test_older_spellings_rejected_with_pointer(capsys, extra, needle):
    assert needle in _error(capsys, BASE + extra, 1)


def test_pack_dataset_and_dynapipe_packed_rows_parse_for_t5():
    t5 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--encoder-seq-length", "64",
          "--decoder-seq-length", "32", "--data-path", "in", "--targets-data-path", "out",
          "--tokens-per-global-batch", "512", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert parse_args(t5 + ["--pack-dataset"], world_size=1, model_type="t5").data.pack_dataset
    cfg = parse_args(t5 + ["--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_t5.json",
                           "--dynapipe-cost-model-any", "--dynapipe-packed-rows"], world_size=1, model_type="t5")
    assert cfg.data.dynapipe_packed_rows


# -- --help: every option documented, grouped as Megatron-LM groups them (issue 23) --------------

@pytest.mark.parametrize("model_type", ["gpt", "t5"])
def test_every_option_has_one_line_of_help(model_type):
    import argparse
    from megatron.cli.arguments import build_parser
    p = build_parser(model_type)
    undocumented = [a.option_strings[0] for a in p._actions
                    if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert undocumented == []
    multi_line = [a.option_strings[0] for a in p._actions if a.help and "\n" in a.help]
    assert multi_line == []
    # a suppressed entry is only ever an alias spelling of a documented option (same dest)
    documented = {a.dest for a in p._actions if a.help != argparse.SUPPRESS}
    assert all(a.dest in documented for a in p._actions if a.help == argparse.SUPPRESS)
    groups = [g.title for g in p._action_groups]
    for title in ("network size", "regularization", "training", "initialization", "learning rate", "checkpointing",
                  "mixed precision", "distributed", "validation", "data and dataloader", "logging", "dynapipe",
                  "terapipe", "aceso", "communication compression (Optimus-CC)"):
        assert title in groups


def test_help_fits_a_120_column_terminal():
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].startswith("usage: torchrun --nproc-per-node N pretrain_gpt.py [options]")
    assert max(len(ln) for ln in lines) <= 120
    assert "  --global-batch-size N " in r.stdout and "--micro-batch-size N" in r.stdout
