"""python -m megatron.report: plots and a summary from the scalars the trainer writes (through
torch's own SummaryWriter, as MetricsLogger does) and the checkpoint tracker."""
import os

import pytest

from megatron.report.__main__ import main

pytest.importorskip("matplotlib")
pytest.importorskip("tensorboard")


def test_report_of_a_run_folder(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter
    run = tmp_path / "demo-1"
    w = SummaryWriter(log_dir=str(run / "tensorboard"))
    for it in range(1, 11):
        w.add_scalar("lm loss", 9.0 - 0.3 * it, it)
        w.add_scalar("iteration-time", 0.5, it)
        w.add_scalar("planner/simulated_ms", 250.0, it)  # the planner predicted half the measured time
        w.add_scalar("throughput/tokens-per-second", 1000.0 + it, it)
        for stage in range(2):  # as MetricsLogger writes them (training/stage_memory.py)
            w.add_scalar(f"memory/stage{stage}_peak_rss_mb", 400.0 + 10 * stage + it, it)
    w.add_scalar("lm loss validation", 7.0, 5)
    w.add_scalar("lm loss validation", 6.5, 10)
    w.close()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert main([str(run)]) == 0
    out = run / "report"
    assert sorted(os.listdir(out)) == ["loss.png", "memory.png", "step_time.png", "summary.md", "tokens_per_s.png"]
    text = (out / "summary.md").read_text()
    assert "training loss 8.7000 -> 6.0000" in text
    assert "best 6.5000 (iteration 10)" in text
    assert "measured / predicted step time: median 2.00 (9 iterations" in text
    assert "(iteration 10)" in text and "![loss](loss.png)" in text
    assert "memory per stage at the last log: stage 0 (peak RSS) 410 MiB, stage 1 (peak RSS) 420 MiB" in text
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_a_missing_folder(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
