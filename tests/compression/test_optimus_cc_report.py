"""experiment_scripts/optimus_cc_report.py reads the trainer's lines as they are printed."""
import csv
import importlib.util
import json
import os

from megatron.compression.stats import format_line
from megatron.training.logging import comm_bytes_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report():
    spec = importlib.util.spec_from_file_location("optimus_cc_report",
                                                  os.path.join(ROOT, "experiment_scripts", "optimus_cc_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _log(losses, comm=None, stats=None):
    lines = []
    for i, loss in enumerate(losses, 1):
        lines.append(f" iteration {5 * i:8d}/{5 * len(losses):8d} | consumed samples: 1 | lm loss: {loss:.6E} |")
        if comm:
            lines.append(comm_bytes_line(comm))
        if stats:
            lines.append(format_line(5 * i, stats))
    return "\n".join(lines) + "\n"


def test_report_writes_per_seed_losses_bytes_and_diagnostics(tmp_path):
    comm = dict(pp_act=0.5e6, pp_grad=0.125e6, pp_grad_raw=0.5e6, dp=0.0, dp_raw=0.0, emb=4e6)
    stats = {(1, "pp_grad"): {"n": 2, "raw": 8, "sent": 2, "s": 0.0, "sent_err": (1.4, 2), "residual": (1.8, 2)}}
    for seed, base in (("1", 5.0), ("2", 6.0)):
        (tmp_path / f"baseline_s{seed}.log").write_text(_log([8.0, base, base]))
        (tmp_path / f"cb_lep_s{seed}.log").write_text(_log([8.0, base + 0.5, base + 0.5], comm, stats))
    assert _report().main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["baseline"]["final_loss_per_seed"] == {"1": 6.0, "2": 20 / 3}
    # Final loss = mean of the last three log points: (8 + 5.5 + 5.5) / 3 and (8 + 6.5 + 6.5) / 3.
    assert abs(summary["cb_lep"]["final_loss_mean"] - (19 / 3 + 7) / 2) < 1e-9
    assert abs(summary["cb_lep"]["final_loss_gap_vs_baseline"] - ((19 / 3 + 7) / (6 + 20 / 3) - 1)) < 1e-9
    assert abs(summary["cb_lep"]["mb_per_iteration"] - 4.625) < 1e-9
    assert abs(summary["baseline"]["mb_per_iteration"] - 5.0) < 1e-9  # what the others sent uncompressed
    assert abs(summary["cb_lep"]["compression_stats_mean"]["stage1_pp_grad_sent_err"] - 0.7) < 1e-9
    rows = list(csv.reader(open(tmp_path / "loss_curves.csv")))
    assert rows[0] == ["iteration", "run", "seed", "loss", "mb_per_iteration"] and len(rows) == 1 + 4 * 3
    table = (tmp_path / "table.md").read_text()
    assert "| cb_lep | 6.333 | 7.000 | 6.667 | 4.62 | 0.70 | 0.90 |" in table
