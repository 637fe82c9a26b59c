"""Aceso search vs Megatron's uniform grid, both priced by megatron.aceso's performance model on
the shipped V100 databases. Prints one JSON object per line per model.

Setups (Aceso's artifact): `miniset` GPT-1.3B and T5-770M on 4 GPUs (one node, 12 GB limit,
global batch 512); `eurosys` GPT 350M-13B and T5 770M-11B on 32 GPUs (4 nodes x 8, 30 GB
limit on the 32 GB V100, global batch 1024).

Fields:
* grid_s: predicted iteration time of the best uniform configuration (PP dividing the
  layers, one TP and DP everywhere, micro-batch per DP rank 1-8, full recompute on or off);
* aceso_s: predicted iteration time of our search's best configuration (`--budget-trials`
  evaluated configurations per stage count, 1..16 stages, one process);
* speedup = grid_s / aceso_s; published = the artifact's normalised throughput for that model;
* search_cpu_s / search_wall_s: CPU time and wall time of all searches of that model on one
  core (the grid baseline's enumeration included);
* config: stage GPUs, TP, DP, layers and recompute-op counts of the best configuration.

Both sides include the per-stage data-parallel gradient all-reduce; `--no-allreduce` drops
it, as Aceso's own model does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.aceso.db import SHIPPED_DIR, OpDatabase  # noqa: E402
from megatron.aceso.model import PerfModel, get_model_spec  # noqa: E402
from megatron.aceso.search import best_grid, search_all  # noqa: E402

# (set, model, gpus, memory GB, global batch, published Aceso / Megatron throughput)
SETUPS = [
    ("miniset", "gpt-1.3b", 4, 12, 512, 8.68 / 6.98),
    ("miniset", "t5-770m", 4, 12, 512, 15.14 / 9.94),
    ("eurosys", "gpt-350m", 32, 30, 1024, 1.00),
    ("eurosys", "gpt-1.3b", 32, 30, 1024, 1.22),
    ("eurosys", "gpt-2.6b", 32, 30, 1024, 1.28),
    ("eurosys", "gpt-6.7b", 32, 30, 1024, 1.31),
    ("eurosys", "gpt-13b", 32, 30, 1024, 1.28),
    ("eurosys", "t5-770m", 32, 30, 1024, 1.00),
    ("eurosys", "t5-3b", 32, 30, 1024, 1.47),
    ("eurosys", "t5-6b", 32, 30, 1024, 1.39),
    ("eurosys", "t5-11b", 32, 30, 1024, 1.50),
]


def run(dbset, model, gpus, mem_gb, gbs, published, budget, include_allreduce, granularity="layer"):
    spec = get_model_spec(model)
    pm = PerfModel(OpDatabase(os.path.join(SHIPPED_DIR, dbset), spec.family, spec.size), spec,
                   mem_gb * 1024, include_allreduce=include_allreduce)
    c0, w0 = time.process_time(), time.perf_counter()
    grid, _ = best_grid(pm, gpus, gbs)
    res = search_all(pm, gpus, gbs, budget_trials=budget, granularity=granularity)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    best = next(r for r in res if r.best.key[0] == 0).best
    layers = []
    for st in best.plan.stages:
        layers.append(len({pm.ops[i].layer for i in range(st.start, st.end) if pm.ops[i].layer >= 0}))
    out = {
        "set": dbset, "model": model, "granularity": granularity, "gpus": gpus, "memory_gb": mem_gb, "global_batch": gbs,
        "grid_s": round(grid.key[1] / 1000, 3) if grid else None,
        "aceso_s": round(best.key[1] / 1000, 3),
        "speedup": round(grid.key[1] / best.key[1], 3) if grid else None,
        "published": round(published, 2),
        "search_cpu_s": round(cpu, 2), "search_wall_s": round(wall, 2),
        "trials": sum(r.trials for r in res),
        "config": {
            "micro_batch": best.plan.micro_batch,
            "gpus": [st.gpus for st in best.plan.stages],
            "tp": [st.tp for st in best.plan.stages], "dp": [st.dp for st in best.plan.stages],
            "layers": layers, "ops": [st.end - st.start for st in best.plan.stages],
            "recompute_ops": [sum(st.flags()) for st in best.plan.stages],
        },
        "grid_config": None if grid is None else {
            "pp": len(grid.plan.stages), "tp": grid.plan.stages[0].tp, "dp": grid.plan.stages[0].dp,
            "micro_batch": grid.plan.micro_batch,
            "recompute": any(any(st.flags()) for st in grid.plan.stages)},
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-trials", type=int, default=1000, help="per stage count")
    ap.add_argument("--only", default=None, help="comma-separated set:model filters, e.g. eurosys:gpt-1.3b")
    ap.add_argument("--no-allreduce", action="store_true")
    ap.add_argument("--granularity", choices=["layer", "op"], default="layer",
                    help="stage cuts on layer boundaries (what --aceso-config runs) or anywhere")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    for dbset, model, gpus, mem, gbs, pub in SETUPS:
        if only and f"{dbset}:{model}" not in only:
            continue
        print(json.dumps(run(dbset, model, gpus, mem, gbs, pub, args.budget_trials,
                             not args.no_allreduce, args.granularity)), flush=True)


if __name__ == "__main__":
    main()
