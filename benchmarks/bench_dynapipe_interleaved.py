"""DynaPipe with and without the interleaved schedule (virtual pipeline stages), simulated on the
A100 GPT-6.7B table. Prints one JSON object per (layout, max length).

Setup: GPT-6.7B (32 layers, hidden 4096), 8 GPUs as PP4 x DP2 or PP8 x DP1, TP 1, 36000 MB per
device (the planner's defaults: 16-bit weights + grads, Adam state sharded over DP), 65,536
tokens per global batch drawn from `bench_planner`'s multi-task mixture (same seeds, so the
same batches for every variant). Variants per layout:

* ``v1``: DynaPipe as it is (one stage per rank; 1F1B and the memory-admitting adaptive
  schedule, every order search);
* ``v1_1f1b``: the same restricted to 1F1B, the schedule the interleaved one generalises;
* ``v2`` / ``v4``: DynaPipe over PP * v virtual stages, v chunks per rank
  (`megatron.planner.dynapipe.interleaved`), only where the layers split evenly.

Reported per variant: simulated iteration time (mean over `--iters` batches, ms), the recompute
levels picked, planning time (median ms, single thread); and ``speedup_v<k>`` = v1 time /
v<k> time (> 1: interleaving is faster in simulation). Simulated only: the interleaved
schedule sends v times as many activation messages, charged at the NVSwitch bandwidth of
`DynaPipeConfig` (intra-node).

    python benchmarks/bench_dynapipe_interleaved.py [--iters 4] [--max-lens 2048,4096]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_planner import make_batches  # noqa: E402
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner  # noqa: E402

LAYOUTS = {"pp4_dp2": (4, 2), "pp8_dp1": (8, 1)}
LAYERS = 32


def variants(pp):
    out = {"v1": dict(virtual_stages=1), "v1_1f1b": dict(virtual_stages=1, schedules=("1f1b",))}
    for v in (2, 4):
        if LAYERS % (pp * v) == 0:
            out[f"v{v}"] = dict(virtual_stages=v)
    return out


def run(layout, max_len, args):
    pp, dp = LAYOUTS[layout]
    batches = make_batches("gpt", max_len, args.tokens, args.iters, seed=1000 + max_len)
    row = {"bench": "dynapipe_interleaved", "model": "gpt-6.7b", "layout": layout, "max_len": max_len,
           "iters": args.iters, "tokens_per_batch": args.tokens}
    for name, kw in variants(pp).items():
        cfg = DynaPipeConfig(cost_model_path=str(ROOT / "cost_models" / "gpt_6.7b_a100.json"), model_kind="gpt",
                             hidden_size=4096, num_layers=LAYERS, pipeline_parallel=pp, data_parallel=dp,
                             memory_limit_mb=36000, emit_plans=False, **kw)
        planner = DynaPipePlanner(cfg)
        times, plan_ms, levels, errors = [], [], {}, 0
        for b in batches:
            t0 = time.perf_counter()
            try:
                plan = planner.plan(b)
            except Exception as e:  # a variant that finds no plan for a batch says so
                errors += 1
                row[f"{name}_error"] = str(e)[:200]
                continue
            plan_ms.append((time.perf_counter() - t0) * 1e3)
            times.append(plan.makespan_ms)
            levels[plan.recompute] = levels.get(plan.recompute, 0) + 1
        row[f"{name}_iteration_ms"] = round(statistics.mean(times), 2) if times else None
        row[f"{name}_recompute"] = levels
        row[f"{name}_planning_ms_median"] = round(statistics.median(plan_ms), 1) if plan_ms else None
        row[f"{name}_no_plan"] = errors
    base = row.get("v1_iteration_ms")
    for name in variants(pp):
        if name != "v1" and base and row.get(f"{name}_iteration_ms") and not row[f"{name}_no_plan"]:
            row[f"speedup_{name}"] = round(base / row[f"{name}_iteration_ms"], 4)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4, help="global batches per configuration")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per global batch")
    ap.add_argument("--max-lens", default="2048,4096", help="comma-separated max sequence lengths")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated of {sorted(LAYOUTS)}")
    args = ap.parse_args(argv)
    for layout in args.layouts.split(","):
        for L in (int(x) for x in args.max_lens.split(",")):
            print(json.dumps(run(layout, L, args)), flush=True)


if __name__ == "__main__":
    main()
