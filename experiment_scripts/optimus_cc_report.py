"""Summarise the logs of run_optimus_cc.sh: loss curves, final loss gap to the baseline, bytes,
compression diagnostics.

  python experiment_scripts/optimus_cc_report.py OUT_DIR

Reads OUT_DIR/<run>_s<seed>.log (or <run>.log, one seed); writes OUT_DIR/summary.json (per
run: final loss per seed and mean, gap to the baseline, bytes per iteration, the mean
--log-compression-stats values), OUT_DIR/loss_curves.csv (iteration, run, seed, loss,
bytes_per_iteration) and, with matplotlib, OUT_DIR/loss_curves.png.
"""
from __future__ import annotations

import csv
import json
import pathlib
import re
import statistics
import sys

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.Ee+-]+|nan)")
VALID = re.compile(r"validation loss .*?: ([0-9.Ee+-]+)")
COMM = re.compile(r"pipeline activations: ([0-9.]+) MB \| pipeline gradients: ([0-9.]+) MB \(uncompressed ([0-9.]+) MB"
                  r".*?data-parallel: ([0-9.]+) MB \(uncompressed ([0-9.]+) MB.*?embedding sync: ([0-9.]+) MB")
STATS = re.compile(r"stage (\d+) (\w+): [0-9.a-z]+x((?: \w+ [0-9.eE+-]+)*) [0-9.]+ ms")
NAME = re.compile(r"^(.*?)(?:_s(\d+))?$")
ORDER = ("baseline", "cb", "cb_lep", "cb_lep_carry", "cb_epilogue", "cb_lep_epilogue", "cb_lep_dp", "dp", "dp_rsvd",
         "emb")


def parse(path: pathlib.Path) -> dict:
    text = path.read_text(errors="replace")
    curve = [(int(i), float(v)) for i, v in ITER.findall(text)]
    valid = [float(v) for v in VALID.findall(text)]
    comm = COMM.findall(text)
    out = {"curve": curve, "final_loss": curve[-1][1] if curve else None,
           "final_window_loss": sum(v for _, v in curve[-3:]) / len(curve[-3:]) if curve else None,
           "validation_loss": valid[-1] if valid else None}
    if comm:
        act, pg, pg_raw, dp, dp_raw, emb = map(float, comm[-1])
        out.update(pp_act_mb=act, pp_grad_mb=pg, pp_grad_raw_mb=pg_raw, dp_mb=dp, dp_raw_mb=dp_raw, emb_mb=emb,
                   mb_per_iteration=act + pg + dp + emb)
    stats: dict = {}
    for line in text.splitlines():
        if "compression stats" not in line:
            continue
        for stage, kind, fields in STATS.findall(line):
            vals = fields.split()
            for name, v in zip(vals[::2], vals[1::2]):
                stats.setdefault(f"stage{stage}_{kind}_{name}", []).append(float(v))
    out["stats_mean"] = {k: statistics.fmean(v) for k, v in stats.items()}
    out["stats_last"] = {k: v[-1] for k, v in stats.items()}
    return out


def markdown_table(summary: dict) -> str:
    """The README's table: final loss per seed and mean, MB per iteration, diagnostics."""
    seeds = sorted({s for row in summary.values() for s in row["final_loss_per_seed"]}, key=str)
    head = ["run", *[f"seed {s}" for s in seeds], "mean", "MB / iteration", "sent_err", "residual"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, row in summary.items():
        st = row["compression_stats_mean"]

        def stat(name):
            vals = [v for k, v in st.items() if k.endswith("pp_grad_" + name)]
            return f"{vals[0]:.2f}" if vals else "-"
        per = [f"{row['final_loss_per_seed'][s]:.3f}" if s in row["final_loss_per_seed"] else "-" for s in seeds]
        mb = row.get("mb_per_iteration")
        lines.append("| " + " | ".join([run, *per, f"{row['final_loss_mean']:.3f}", f"{mb:.2f}" if mb else "-",
                                        stat("sent_err"), stat("residual")]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(argv[0])
    logs = {}
    for p in sorted(root.glob("*.log")):
        r = parse(p)
        if r["curve"]:
            run, seed = NAME.match(p.stem).groups()
            logs.setdefault(run, {})[seed or "-"] = r
    if not logs:
        print(f"optimus_cc_report: no training logs with loss lines in {root}", file=sys.stderr)
        return 1
    summary = {}
    for run in sorted(logs, key=lambda k: (ORDER.index(k) if k in ORDER else 99, k)):
        seeds = logs[run]
        finals = {s: r["final_window_loss"] for s, r in seeds.items()}
        any_r = next(iter(seeds.values()))
        row = {"final_loss_per_seed": finals, "final_loss_mean": statistics.fmean(finals.values()),
               "mb_per_iteration": any_r.get("mb_per_iteration"),
               "pp_grad_mb_per_iteration": any_r.get("pp_grad_mb"), "dp_mb_per_iteration": any_r.get("dp_mb"),
               "emb_mb_per_iteration": any_r.get("emb_mb")}
        keys = set().union(*(r["stats_mean"] for r in seeds.values()))
        row["compression_stats_mean"] = {k: statistics.fmean(r["stats_mean"][k] for r in seeds.values()
                                                              if k in r["stats_mean"]) for k in sorted(keys)}
        summary[run] = row
    # A run without compression logs no byte line (before --log-compression-stats printed one):
    # it sent what the others would have sent uncompressed, when none compresses the embedding.
    donors = [r for seeds in logs.values() for r in seeds.values() if "pp_grad_raw_mb" in r]
    for run, row in summary.items():
        if row["mb_per_iteration"] is None and donors and run == "baseline":
            d = donors[0]
            row["mb_per_iteration"] = d["pp_act_mb"] + d["pp_grad_raw_mb"] + d["dp_raw_mb"] + d["emb_mb"]
            row["mb_per_iteration_note"] = "uncompressed bytes logged by the compressed runs"
            for r in logs[run].values():
                r["mb_per_iteration"] = row["mb_per_iteration"]
    base = summary.get("baseline", {}).get("final_loss_mean")
    if base:
        for row in summary.values():
            row["final_loss_gap_vs_baseline"] = row["final_loss_mean"] / base - 1.0
    (root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (root / "table.md").write_text(markdown_table(summary))
    with open(root / "loss_curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", "run", "seed", "loss", "mb_per_iteration"])
        for run in summary:
            for seed, r in sorted(logs[run].items()):
                for it, loss in r["curve"]:
                    w.writerow([it, run, seed, loss, r.get("mb_per_iteration", "")])
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("optimus_cc_report: matplotlib is not installed (pip install -e '.[experiments]'): wrote summary.json "
              "and loss_curves.csv only", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, run in enumerate(summary):
        color = f"C{i}"
        curves = [r["curve"] for r in logs[run].values()]
        n = min(len(c) for c in curves)
        xs = [c[0] for c in curves[0][:n]]
        mean = [statistics.fmean(c[j][1] for c in curves) for j in range(n)]
        for c in curves:
            ax.plot([x for x, _ in c], [y for _, y in c], color=color, alpha=0.25, linewidth=0.8)
        mb = summary[run]["mb_per_iteration"]
        label = f"{run} ({mb:.2f} MB/iter)" if mb is not None else run
        ax.plot(xs, mean, color=color, linewidth=1.6, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (log-interval average; thin: seeds)")
    ax.set_title(f"Optimus-CC on CPU ({len(next(iter(logs.values())))} seeds), King James text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "loss_curves.png", dpi=120)
    print(f"optimus_cc_report: wrote {root / 'loss_curves.png'} and {root / 'loss_curves.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
