"""Summarise the logs of run_optimus_cc.sh: loss curves, final loss gap to the baseline, bytes.

  python experiment_scripts/optimus_cc_report.py OUT_DIR
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.Ee+-]+|nan)")
VALID = re.compile(r"validation loss .*?: ([0-9.Ee+-]+)")
COMM = re.compile(r"pipeline gradients: ([0-9.]+) MB \(uncompressed ([0-9.]+) MB.*?data-parallel: ([0-9.]+) MB "
                  r"\(uncompressed ([0-9.]+) MB")
ORDER = ("baseline", "cb", "cb_lep", "cb_lep_dp", "cb_lep_epilogue", "dp")


def parse(path: pathlib.Path) -> dict:
    text = path.read_text(errors="replace")
    curve = [(int(i), float(v)) for i, v in ITER.findall(text)]
    valid = [float(v) for v in VALID.findall(text)]
    comm = COMM.findall(text)
    out = {"curve": curve, "final_loss": curve[-1][1] if curve else None,
           "final_window_loss": sum(v for _, v in curve[-3:]) / len(curve[-3:]) if curve else None,
           "validation_loss": valid[-1] if valid else None}
    if comm:
        pg, pg_raw, dp, dp_raw = map(float, comm[-1])
        out.update(pp_grad_mb=pg, pp_grad_raw_mb=pg_raw, dp_mb=dp, dp_raw_mb=dp_raw,
                   pp_grad_reduction=pg_raw / pg if pg else None, dp_reduction=dp_raw / dp if dp else None)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(argv[0])
    runs = {p.stem: parse(p) for p in sorted(root.glob("*.log"))}
    runs = {k: v for k, v in runs.items() if v["curve"]}
    if not runs:
        print(f"optimus_cc_report: no training logs with loss lines in {root}", file=sys.stderr)
        return 1
    base = runs.get("baseline", {}).get("final_window_loss")
    summary = {}
    for name in sorted(runs, key=lambda k: (ORDER.index(k) if k in ORDER else 99, k)):
        r = runs[name]
        row = {k: v for k, v in r.items() if k != "curve"}
        if base:
            row["final_loss_gap_vs_baseline"] = r["final_window_loss"] / base - 1.0
        summary[name] = row
    (root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("optimus_cc_report: matplotlib is not installed (pip install -e '.[experiments]'): wrote summary.json only",
              file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in summary:
        xs, ys = zip(*runs[name]["curve"])
        ax.plot(xs, ys, label=name, linewidth=1.3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (log-interval average)")
    ax.set_title("Optimus-CC on CPU: GPT 4L h128, PP=2 x DP=2, King James text")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "loss_curves.png", dpi=120)
    print(f"optimus_cc_report: wrote {root / 'loss_curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
