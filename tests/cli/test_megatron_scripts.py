"""Megatron-LM's own launch scripts (their flag lists, tests/fixtures/megatron_scripts/, each naming
its repository, tag and path) go through this project's entry points at tiny sizes: every flag is
honoured, accepted with one log line, or refused naming what to use instead; two of them train
2 iterations on CPU (gloo)."""
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron.cli.arguments import build_parser, parse_args
from megatron.cli.arguments_megatron import _ENGINE, _REFUSED
from tests.checkpointing.gpt2_files import write_gpt2_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "megatron_scripts", "*.json")))
WORDPIECE = os.path.join(ROOT, "data", "tokenizers", "kjv_wordpiece-vocab.txt")

# The sizes a script sets for a GPU cluster, replaced by ones a CPU runs in seconds.
TINY = {
    "--num-layers": "2", "--encoder-num-layers": "1", "--decoder-num-layers": "1", "--hidden-size": "32",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "8", "--ffn-hidden-size": "64",
    "--seq-length": "16", "--max-position-embeddings": "16", "--encoder-seq-length": "16",
    "--decoder-seq-length": "8", "--micro-batch-size": "1", "--global-batch-size": "2",
    "--rampup-batch-size": "1 1 2", "--step-batch-size-schedule": "0:1 32:2", "--train-iters": "2",
    "--train-samples": "4", "--lr-decay-samples": "4", "--lr-warmup-samples": "1", "--lr-decay-iters": "2",
    "--lr": "1e-3", "--min-lr": "1e-4", "--weight-decay": "0.1", "--adam-beta1": "0.9", "--adam-beta2": "0.95",
    "--init-method-std": "0.02", "--clip-grad": "1.0", "--lr-warmup-fraction": "0.1", "--rotary-base": "10000",
    "--rotary-percent": "1.0", "--attention-dropout": "0.0", "--hidden-dropout": "0.0",
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--context-parallel-size": "1",
    "--log-interval": "1", "--save-interval": "100", "--eval-interval": "1000", "--eval-iters": "1",
    "--vocab-size": "128", "--vocab-extra-ids": "4", "--num-workers": "0", "--exit-duration-in-mins": "235",
    "--empty-unused-memory-level": "1", "--profile-step-start": "1", "--profile-step-end": "2",
    "--distributed-timeout-minutes": "5", "--fp8-amax-history-len": "16", "--decoupled-lr": "5e-4",
    "--decoupled-min-lr": "4.5e-5",
}
# Scripts whose default flags combine into something refused here: (the error's words, the flags
# dropped to run the rest unchanged).
COMBINATIONS: dict = {}  # (none now: the Llama example's --decoupled-lr with the distributed optimizer runs)


def _dropped(name):
    return COMBINATIONS.get(name, ("", ()))[1]


def _load(path):
    with open(path) as f:
        return json.load(f)


def _branch_ok(flag, which):
    when = flag.get("when", "")
    if when.startswith("DTYPE=fp8"):
        return which == "fp8"
    if when.startswith("a real dataset"):
        return False  # the mock-data branch is the script's default, and needs no tokenizer download
    return True


def script_argv(doc, tmp, which="default", drop=()):
    """The script's flags with tiny sizes, its data as generated tokens, its paths under `tmp`."""
    vocab, merges = write_gpt2_files(str(tmp / "gpt2"))
    paths = {"--save": str(tmp / "ckpt"), "--load": str(tmp / "ckpt"), "--tensorboard-dir": str(tmp / "tb"),
             "--data-cache-path": str(tmp / "cache"), "--merge-file": merges}
    wordpiece = any(f.get("value", "").startswith("BertWordPiece") for f in doc["flags"])
    paths["--vocab-file"] = WORDPIECE if wordpiece else vocab
    argv, seen = [], set()
    for f in doc["flags"]:
        name = f["flag"]
        if not _branch_ok(f, which) or name in seen or name in drop:
            continue
        seen.add(name)
        if name == "--data-path":
            if "--mock-data" not in seen:
                argv.append("--mock-data")
                seen.add("--mock-data")
            continue
        if name == "--mock-data" and "--mock-data" in argv:
            continue
        if f["kind"] == "switch":
            argv.append(name)
        elif name in paths:
            argv += [name, paths[name]]
        elif name in TINY:
            argv += [name, *TINY[name].split(" ")] if f["kind"] == "ints" else [name, TINY[name]]
        elif f["kind"] == "str":
            argv += [name, f["value"]]
        else:
            raise AssertionError(f"{name} ({f['kind']}): add a tiny value to TINY")
    return argv


def _entry(doc):
    return "t5" if doc["source"]["entry"] == "pretrain_t5.py" else "gpt"


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(p)[:-5] for p in SCRIPTS])
def test_every_flag_of_the_script_is_known(path):
    """No flag of a Megatron-LM example script is unknown to the entry point (argparse would stop)."""
    doc = _load(path)
    assert doc["source"]["repo"] == "NVIDIA/Megatron-LM" and doc["source"]["tag"] and doc["source"]["path"]
    known = {o for a in build_parser(_entry(doc))._actions for o in a.option_strings}
    assert [f["flag"] for f in doc["flags"] if f["flag"] not in known] == []


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(p)[:-5] for p in SCRIPTS])
def test_script_flags_parse_at_tiny_sizes(path, tmp_path, capsys):
    """The whole flag list parses; each engine choice prints one line saying what happens here."""
    doc = _load(path)
    name = os.path.basename(path)[:-5]
    drop = ()
    if name in COMBINATIONS:
        words, drop = COMBINATIONS[name]
        with pytest.raises(SystemExit):
            parse_args(script_argv(doc, tmp_path), model_type=_entry(doc), world_size=1)
        assert words in capsys.readouterr().err
    cfg = parse_args(script_argv(doc, tmp_path, drop=drop), model_type=_entry(doc), world_size=1)
    out = capsys.readouterr().out
    for flag in {f["flag"] for f in doc["flags"] if _branch_ok(f, "default")} & set(_ENGINE):
        assert sum(line.startswith(f"note: {flag}") for line in out.splitlines()) == 1, (flag, out)
    assert cfg.training.train_iters >= 1 and cfg.model.hidden_size == 32


def test_fp8_branch_is_refused_naming_bf16(tmp_path, capsys):
    """The Llama script's fp8 flags (its DTYPE=fp8 branch) are refused, naming --bf16."""
    doc = _load(os.path.join(ROOT, "tests", "fixtures", "megatron_scripts", "llama3_8b_core_v0.19.0.json"))
    fp8 = [f["flag"] for f in doc["flags"] if f.get("when", "").startswith("DTYPE=fp8")]
    assert fp8 and set(fp8) <= set(_REFUSED)
    with pytest.raises(SystemExit) as e:
        parse_args(script_argv(doc, tmp_path, which="fp8", drop=_dropped("llama3_8b_core_v0.19.0")),
                   world_size=1)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --fp8" in err and "use --bf16" in err


def test_sequence_parallel_at_tp1_is_said(tmp_path, capsys):
    doc = _load(os.path.join(ROOT, "tests", "fixtures", "megatron_scripts", "llama3_8b_core_v0.19.0.json"))
    parse_args(script_argv(doc, tmp_path, drop=_dropped("llama3_8b_core_v0.19.0")), world_size=1)
    assert "note: --sequence-parallel has no effect at --tensor-model-parallel-size 1" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpt3_175b_core_v0.9.0", "llama3_8b_core_v0.19.0"])
def test_script_trains_two_iterations(name, tmp_path):
    """The script's flags (tiny sizes, generated tokens) through pretrain_gpt.py: 2 iterations,
    a checkpoint, the ramp-up / sample count and the engine notes in the log."""
    doc = _load(os.path.join(ROOT, "tests", "fixtures", "megatron_scripts", name + ".json"))
    argv = script_argv(doc, tmp_path, drop=_dropped(name))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MEGATRON_NO_FUSED_KERNELS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], env=env,
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " iteration        2/       2 |" in out.stdout, out.stdout[-3000:]
    assert open(os.path.join(tmp_path, "ckpt", "latest_checkpointed_iteration.txt")).read().strip() == "2"
    if name.startswith("gpt3"):  # --rampup-batch-size 1 1 2: batches of 1 then 2 samples
        assert "consumed samples:            1 |" in out.stdout and "consumed samples:            2 |" in out.stdout
    else:  # --train-samples 4 of 2: 2 iterations; engine choices said once
        assert "note: --train-samples 4: 2 iterations of 2 samples" in out.stdout
        assert "note: --attention-backend fused:" in out.stdout
