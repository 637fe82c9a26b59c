"""--profile: a tiny CPU run writes one loadable Chrome trace covering exactly the profiled
iterations, and the flags are checked before anything runs."""
import json

import pytest
import torch

from megatron.cli.arguments import parse_args
from megatron.config.core import LoggingConfig
from megatron.core.parallel_state import ParallelState
from megatron.training.initialize import set_seeds
from megatron.training.pretrain import build_gpt_trainer

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "64", "--train-iters", "4", "--log-interval", "100"]


def test_profile_writes_chrome_trace_of_the_window(tmp_path):
    cfg = parse_args(BASE + ["--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                             "--profile-dir", str(tmp_path / "prof")], world_size=1)
    ps = ParallelState()
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    trainer.train()
    files = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert files == ["trace_rank0_iters2-3.json"]
    trace = json.loads((tmp_path / "prof" / files[0]).read_text())
    steps = {ev["name"] for ev in trace["traceEvents"] if ev.get("name", "").startswith("iteration ")}
    assert steps == {"iteration 2", "iteration 3"}
    assert any(ev.get("name") == "aten::mm" or ev.get("name") == "aten::addmm" for ev in trace["traceEvents"])


def test_profile_on_other_ranks_only_writes_nothing(tmp_path):
    cfg = parse_args(BASE + ["--profile", "--profile-ranks", "1", "--profile-step-start", "1", "--profile-step-end",
                             "2", "--train-iters", "1", "--profile-dir", str(tmp_path)], world_size=1)
    ps = ParallelState()
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    build_gpt_trainer(cfg, ps, torch.device("cpu")).train()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [["--profile"], ["--profile", "--profile-dir", "x", "--profile-step-start", "5",
                                                   "--profile-step-end", "5"]])
def test_bad_profile_flags_exit_2(extra, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + extra, world_size=1)
    assert e.value.code == 2
    assert "--profile" in capsys.readouterr().err
