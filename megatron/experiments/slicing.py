"""The composed figure: DynaPipe alone vs DynaPipe with TeraPipe token slices vs TeraPipe alone
vs packing, GPT-6.7B (A100 table, cost_models/gpt_6.7b_a100.json), 8 GPUs, simulated.

    python -m megatron.experiments.slicing --out DIR [--max-lens 2048,4096,8192,16384] [--batches 3]

writes DIR/dynapipe_slicing.csv (one row per max length and system) and, with matplotlib,
DIR/dynapipe_slicing.png (training throughput vs max length). Global batches of 65,536
tokens drawn from the shipped multi-task lengths scaled to each max length
(`megatron.experiments.lengths`). Each system gets the faster of the two 8-GPU layouts
PP4 x DP2 and PP8 x DP1 (TP1), 36,000 MB per GPU, and every time comes from the same cost
table and simulator:

* dynapipe: `DynaPipePlanner` (variable micro-batches, recompute level, schedule);
* dynapipe_slices: the same planner with `token_slices=-1` (megatron/planner/dynapipe/slicing.py);
* terapipe: TeraPipe's setting: samples packed next-fit into rows of max length, attention over
  the whole row, uniform micro-batches of b rows (b = 1, 2), each cut by TeraPipe's slice DP,
  no full recompute, the sliced schedules of dynapipe_slicing;
* packing: the packing baseline (`megatron.planner.dynapipe.baselines`, next-fit rows, 1F1B, best
  micro-batch size and recompute level).

A system that fits no plan for a batch is infeasible at that max length (throughput 0 in the
CSV, left out of the plot). Simulated: no A100 was used.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from megatron.atomic import atomic_open
from megatron.experiments.config import ROOT

SYSTEMS = ("dynapipe", "dynapipe_slices", "terapipe", "packing")
LAYOUTS = ((4, 2), (8, 1))  # (PP, DP) on 8 GPUs
TOKENS = 65536


def planner_for(pp: int, dp: int, token_slices: int = 0, cost_model: str = "cost_models/gpt_6.7b_a100.json"):
    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    return DynaPipePlanner(DynaPipeConfig(cost_model_path=str(ROOT / cost_model), model_kind="gpt", hidden_size=4096,
                                          num_layers=32, pipeline_parallel=pp, data_parallel=dp,
                                          memory_limit_mb=36000, token_slices=token_slices, emit_plans=False))


def terapipe_time(planner, batch, max_len: int) -> float:
    from megatron.planner.dynapipe import slicing as ds
    from megatron.planner.dynapipe import packed
    rows = packed.next_fit("gpt", batch, max_len)
    best = np.inf
    for rc in ("none", "selective"):
        if not planner.cm.has(planner.cfg.tensor_parallel, rc):
            continue
        for b in (1, 2):
            mbs = [rows[k:k + b] for k in range(0, len(rows), b)]
            groups = packed.contiguous_groups(len(mbs), planner.cfg.data_parallel)
            if groups is None:
                continue
            t = 0.0
            for g in groups:
                shapes = [(len(mbs[i]), max_len) for i in g]
                k_eff = 1.0 + (planner.S - 1) / len(g)
                sl = ds.dp_slicing(planner, rc, shapes[0][0], max_len, k_eff, ds._cap(planner))
                got = ds.search_group(planner, rc, shapes, [sl] * len(shapes), [list(range(len(g)))], best)
                t = max(t, np.inf if got is None else got.makespan)
            best = min(best, t)
    return best


def system_time(system: str, planners: dict, batch, max_len: int) -> float:
    """Simulated iteration time (ms) of one global batch; inf when no plan fits."""
    from megatron.planner.dynapipe.baselines import baselines
    from megatron.planner.dynapipe.planner import PlanningError
    if system in ("dynapipe", "dynapipe_slices"):
        try:
            return float(planners[system].plan(batch, validate=False).makespan_ms)
        except PlanningError:
            return np.inf
    if system == "terapipe":
        return terapipe_time(planners["dynapipe"], batch, max_len)
    return float(baselines(planners["dynapipe"], "gpt", batch, max_len, names=("packing",))["packing"][0])


def compare(max_len: int, batches, systems=SYSTEMS, layouts=LAYOUTS) -> List[dict]:
    """Per system: the best layout's mean iteration time over `batches` (inf if a batch fits
    no plan there) and throughput in real tokens per second."""
    tokens = sum(sum(b) for b in batches)
    out = []
    for system in systems:
        best = None
        for pp, dp in layouts:
            planners = {"dynapipe": planner_for(pp, dp), "dynapipe_slices": planner_for(pp, dp, -1)}
            times = [system_time(system, planners, b, max_len) for b in batches]
            total = float(np.sum(times))
            if best is None or total < best["total_ms"]:
                best = {"max_len": max_len, "system": system, "layout": f"PP{pp}xDP{dp}", "total_ms": total,
                        "per_batch_ms": [round(t, 1) for t in times]}
        best["mean_ms"] = best["total_ms"] / len(batches)
        best["tokens_per_s"] = tokens / (best["total_ms"] / 1e3) if np.isfinite(best["total_ms"]) else 0.0
        out.append(best)
    return out


def batches_for(max_len: int, n: int, lengths_file=None) -> list:
    from megatron.experiments.lengths import draw_batches, load_lengths
    return draw_batches(load_lengths(lengths_file), "gpt", max_len, TOKENS, n, seed=7 + max_len)


def write(rows: List[dict], out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dynapipe_slicing.csv"
    with atomic_open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["max_len", "system", "layout", "mean_iteration_ms", "tokens_per_s"])
        for r in rows:
            w.writerow([r["max_len"], r["system"], r["layout"],
                        f"{r['mean_ms']:.1f}" if np.isfinite(r["mean_ms"]) else "inf", f"{r['tokens_per_s']:.0f}"])
    written = [path]
    from megatron.experiments.figures import _plt
    plt = _plt()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in SYSTEMS:
            pts = [(r["max_len"], r["tokens_per_s"]) for r in rows if r["system"] == system and r["tokens_per_s"] > 0]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max sequence length")
        ax.set_ylabel("simulated tokens / s")
        ax.set_title("GPT-6.7B, 8 x A100, simulated")
        ax.legend()
        fig.tight_layout()
        png = out / "dynapipe_slicing.png"
        fig.savefig(png)
        plt.close(fig)
        written.append(png)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.experiments.slicing", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "reproduced_figures"), help="folder for the CSV and PNG")
    p.add_argument("--max-lens", default="2048,4096,8192,16384", help="comma-separated max sequence lengths")
    p.add_argument("--batches", type=int, default=3, help="global batches per max length")
    p.add_argument("--lengths-file", default=None, help="sample lengths, one 'input target' pair per line")
    args = p.parse_args(argv)
    try:
        max_lens = [int(x) for x in args.max_lens.split(",")]
    except ValueError:
        print(f"error: --max-lens {args.max_lens!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    rows: List[Dict] = []
    t0 = time.monotonic()
    for i, L in enumerate(max_lens, 1):
        rows += compare(L, batches_for(L, args.batches, args.lengths_file))
        print(f"slicing: max length {L} done ({i}/{len(max_lens)}, {time.monotonic() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    for path in write(rows, Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
