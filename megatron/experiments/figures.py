"""Figures 13-18 of DynaPipe from the result rows: one PNG per sub-figure and its data as CSV
beside it, in reproduced_figures/. matplotlib is the optional `experiments` extra
(`pip install -e .[experiments]`); without it the CSVs are still written and the command says so.

* Fig 13 / 14: throughput (real tokens/s) vs max sequence length, per model and cluster size;
  best configuration per system (13) and baselines at DynaPipe's parallelism (14).
* Fig 15: padding efficiency (real / computed tokens) vs max length, per system.
* Fig 16: ablation, throughput of each variant relative to full DynaPipe.
* Fig 17: planning time per iteration (distribution) vs max length.
* Fig 18: cost-model accuracy: predicted vs measured iteration time and peak memory (live rows).
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np

from megatron.experiments.rows import read_rows

SYSTEM_STYLE = {"dynapipe": ("DynaPipe", "o-"), "packing": ("Megatron + packing (dense rows, paper)", "s--"),
                "packing_varlen": ("Megatron + packing, per-document attention", "d--"),
                "packing_balanced": ("WLB-LLM balanced packing", "v--"),
                "fixed": ("Megatron, fixed micro-batches", "^:")}


def _write_csv(path: Path, header: List[str], rows: List[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _groups(rows, *keys) -> Dict[tuple, List[dict]]:
    out = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return dict(sorted(out.items()))


def _line_figure(plt, rows, value, ylabel, title, path, scale=1.0):
    """One line per system: value vs max length."""
    lens = sorted({r["max_len"] for r in rows})
    data = []
    for r in sorted(rows, key=lambda r: (r["system"], r["max_len"])):
        v = r[value] if r["status"] == "ok" else None
        data.append([r["system"], r["max_len"], r["pp"], r["tp"], r["dp"], r["micro_batch_size"], r["recompute"],
                     r["status"], "" if v is None else round(v, 4)])
    # A system with rows at some max lengths but none at another (no configuration of it fits,
    # so the grid search wrote null and no job ran) is a gap, not a point to draw a line through.
    systems = {r["system"] for r in rows}
    for system in sorted(systems):
        have = {r["max_len"] for r in rows if r["system"] == system}
        data += [[system, L, "", "", "", "", "", "no feasible configuration", ""] for L in lens if L not in have]
    _write_csv(path.with_suffix(".csv"), ["system", "max_len", "pp", "tp", "dp", "micro_batch_size", "recompute",
                                          "status", value], data)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    any_bad = False
    for system, (label, style) in SYSTEM_STYLE.items():
        if system not in systems:
            continue
        val = {r["max_len"]: r[value] * scale for r in rows if r["system"] == system and r["status"] == "ok"}
        # NaN where a point is infeasible or missing: the line breaks there instead of bridging it.
        line, = ax.plot(lens, [val.get(L, np.nan) for L in lens], style, label=label)
        bad = [L for L in lens if L not in val]
        if bad:
            any_bad = True
            ax.plot(bad, [0] * len(bad), "x", color=line.get_color(), ms=10, mew=2, clip_on=False, zorder=5)
    if any_bad:
        ax.plot([], [], "x", color="gray", ms=10, mew=2, label="on the axis: nothing fits memory (or the run failed)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens)
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("max sequence length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    # Beside the axes, not on them: inside, "best" still covered a line where every corner holds one.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _mode(rows) -> str:
    return "simulated" if rows and rows[0]["backend"] == "simulate" else "live"


def fig_throughput(plt, rows, out: Path, num: int, what: str) -> List[Path]:
    paths = []
    for (grid, model, gpus), rs in _groups(rows, "grid", "model", "gpus").items():
        p = out / f"fig{num}_{grid}_{model}_G{gpus}.png"
        _line_figure(plt, rs, "tokens_per_s", "throughput (real tokens / s)",
                     f"Fig {num} ({_mode(rs)}): {model}, {gpus} GPUs, {what}", p)
        paths.append(p)
    return paths


def fig15(plt, rows, out: Path) -> List[Path]:
    paths = []
    for (grid, model, gpus), rs in _groups(rows, "grid", "model", "gpus").items():
        p = out / f"fig15_{grid}_{model}_G{gpus}.png"
        _line_figure(plt, rs, "padding_efficiency", "padding efficiency (real / computed tokens)",
                     f"Fig 15 ({_mode(rs)}): {model}, {gpus} GPUs, batching efficiency", p)
        paths.append(p)
    return paths


def fig16(plt, rows, out: Path) -> List[Path]:
    paths = []
    for (grid, model, gpus), rs in _groups(rows, "grid", "model", "gpus").items():
        base = {r["max_len"]: r for r in rs if r["variant"] == "dynapipe" and r["status"] == "ok"}
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        lens = sorted({r["max_len"] for r in rs})
        rel = {}
        for r in rs:
            b = base.get(r["max_len"])
            rel[(r["variant"], r["max_len"])] = (r["tokens_per_s"] / b["tokens_per_s"]
                                                 if r["status"] == "ok" and b else None)
        p = out / f"fig16_{grid}_{model}_G{gpus}.png"
        _write_csv(p.with_suffix(".csv"), ["variant", "max_len", "relative_throughput"],
                   [[v, L, "" if rel.get((v, L)) is None else round(rel[(v, L)], 4)] for v in variants for L in lens])
        paths.append(p)
        if plt is None:
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            ys = [rel.get((v, L)) or 0.0 for L in lens]
            ax.bar(np.arange(len(lens)) + i * w, ys, w, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(lens)) + w * (len(variants) - 1) / 2)
        ax.set_xticklabels([str(L) for L in lens])
        ax.set_xlabel("max sequence length (tokens)")
        ax.set_ylabel("throughput relative to full DynaPipe")
        ax.set_title(f"Fig 16 ({_mode(rs)}): {model}, {gpus} GPUs, ablation (0 = infeasible)", fontsize=10)
        top = max([v for v in rel.values() if v] + [1.0])
        ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=7, ncol=4, loc="upper center")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
    return paths


def fig17(plt, rows, out: Path) -> List[Path]:
    paths = []
    rows = [r for r in rows if r["system"] == "dynapipe" and r["status"] == "ok" and r["planning_ms"]]
    for (grid, model, gpus), rs in _groups(rows, "grid", "model", "gpus").items():
        rs = sorted(rs, key=lambda r: r["max_len"])
        p = out / f"fig17_{grid}_{model}_G{gpus}.png"
        _write_csv(p.with_suffix(".csv"), ["max_len", "iteration", "planning_ms"],
                   [[r["max_len"], i, t] for r in rs for i, t in enumerate(r["planning_ms"])])
        paths.append(p)
        if plt is None:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.boxplot([r["planning_ms"] for r in rs])
        ax.set_xticks(range(1, len(rs) + 1))
        ax.set_xticklabels([str(r["max_len"]) for r in rs])
        ax.set_xlabel("max sequence length (tokens)")
        ax.set_ylabel("planning time per iteration (ms, 1 CPU core)")
        ax.set_title(f"Fig 17 ({_mode(rs)}): {model}, {gpus} GPUs, planning time", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
    return paths


def fig18(plt, rows, out: Path) -> List[Path]:
    """Predicted vs measured per iteration, all live DynaPipe rows (any experiment)."""
    rows = [r for r in rows if r["backend"] == "live" and r["system"] == "dynapipe" and r["status"] == "ok"
            and r["predicted_ms"] and r["measured_ms"]]
    pt = out / "fig18_time.png"
    pm = out / "fig18_memory.png"
    data = []
    for r in rows:
        n = min(len(r["predicted_ms"]), len(r["measured_ms"]))
        for i in range(n):
            mem = r["measured_peak_mb"][i] if r["measured_peak_mb"] else ""
            pk = r["predicted_peak_mb"][i] if r["predicted_peak_mb"] else ""
            data.append([r["experiment"], r["model"], r["max_len"], r["gpus"], r["pp"], r["tp"], r["dp"], i,
                         r["predicted_ms"][i], r["measured_ms"][i], pk, mem])
    _write_csv(pt.with_suffix(".csv"), ["experiment", "model", "max_len", "gpus", "pp", "tp", "dp", "iteration",
                                        "predicted_ms", "measured_ms", "predicted_peak_mb", "measured_peak_mb"], data)
    # The memory panel's own data (the iterations with a predicted peak), as every figure has.
    _write_csv(pm.with_suffix(".csv"), ["experiment", "model", "max_len", "gpus", "pp", "tp", "dp", "iteration",
                                        "predicted_peak_mb", "measured_peak_mb"],
               [d[:8] + d[10:] for d in data if d[10] != ""])
    if plt is None:
        return [pt, pm]
    fig, ax = plt.subplots(figsize=(5, 5))
    for model in sorted({d[1] for d in data}):
        xs = [d[8] for d in data if d[1] == model]
        ys = [d[9] for d in data if d[1] == model]
        ax.scatter(xs, ys, label=model, s=18)
    if data:
        hi = max(max(d[8], d[9]) for d in data) * 1.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = predicted")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ratio = np.mean([d[9] / d[8] for d in data])
        err = np.mean([abs(d[9] - d[8]) / d[9] for d in data])
        # In the title, not in a box on the axes: a box there hid the points under it.
        stats = f"\nmean measured / predicted {ratio:.2f}x, mean relative error {err:.0%}"
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no live DynaPipe rows yet\n(run experiment_scripts/run_benchmark.sh --live)",
                ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("predicted iteration time (ms, cost model + simulator)")
    ax.set_ylabel("measured iteration time (ms)")
    ax.set_title("Fig 18 (live): iteration time, predicted vs measured" + (stats if data else ""), fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(pt, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    have = [d for d in data if d[11] != "" and d[10] != ""]
    if have:
        ax.scatter([d[10] for d in have], [d[11] for d in have], s=18)
        hi = max(max(d[10], d[11]) for d in have) * 1.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = predicted")
        ax.legend(fontsize=8)
        ax.set_ylabel("measured peak activation memory (MB)")
    else:
        preds = [d[10] for d in data if d[10] != ""]
        if preds:
            ax.hist(preds, bins=10)
        ax.yaxis.set_major_locator(plt.matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("iterations")
    ax.set_xlabel("predicted peak activation memory (MB, max over stages)")
    ax.set_title("Fig 18 (live): peak memory, predicted vs measured" + (
        "" if have else "\nmeasured peak n/a on CPU: histogram of the predicted peaks"), fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(pm, dpi=110)
    plt.close(fig)
    return [pt, pm]


def draw(results: Path, out: Path, figs: List[int], backend: str) -> int:
    """Draw the requested figures from `results`/*.jsonl rows of `backend` (Fig 18: live rows)."""
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)

    def rows(name, be=backend):
        """Rows of back-end `be`; a job rerun later (another layout after a new grid search,
        --force) replaces the older row of the same setting, system and variant."""
        latest = {}
        for r in read_rows(results / name):
            if be is None or r["backend"] == be:
                latest[(r["grid"], r["setting"], r["system"], r["variant"])] = r
        return list(latest.values())
    made = []
    for n in figs:
        if n == 13:
            made += fig_throughput(plt, rows("best_throughput.jsonl"), out, 13, "best configuration per system")
        elif n == 14:
            made += fig_throughput(plt, rows("controlled_baseline.jsonl"), out, 14,
                                   "baselines at DynaPipe's parallelism")
        elif n == 15:
            made += fig15(plt, rows("best_throughput.jsonl"), out)
        elif n == 16:
            made += fig16(plt, rows("ablation.jsonl", "simulate"), out)  # the ablation is simulate-only
        elif n == 17:
            made += fig17(plt, rows("best_throughput.jsonl"), out)
        elif n == 18:
            live, seen = [], set()  # benchmark rows copied from the grid search count once
            for f in ("best_throughput.jsonl", "controlled_baseline.jsonl", "grid_search.jsonl"):
                for r in rows(f, "live"):
                    k = (r["grid"], r["setting"], r["system"], r["pp"], r["tp"], r["dp"], str(r["measured_ms"]))
                    if k not in seen:
                        seen.add(k)
                        live.append(r)
            made += fig18(plt, live, out)
        else:
            print(f"error: --fig {n}: figures 13 to 18 only", file=sys.stderr)
            return 2
    if plt is None:
        print("matplotlib is not installed: wrote the CSVs only; install it with "
              "`pip install -e .[experiments]` (or `pip install matplotlib`) for the PNGs", file=sys.stderr)
        for p in made:
            print(f"  {p.with_suffix('.csv')}")
        return 3
    missing = [n for n in figs if not any(p.name.startswith(f"fig{n}") for p in made)]
    for p in made:
        print(f"  {p}")
    if missing:
        print(f"warning: no result rows for figure(s) {missing} in {results} ({backend}); run the sweeps first",
              file=sys.stderr)
    return 0
