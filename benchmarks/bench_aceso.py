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

`--paper`: the paper's settings instead (eurosys tables; GPT 350M/1.3B/2.6B/6.7B/13B on
1/4/8/16/32 GPUs, T5 770M/3B/6B/11B on 1/4/8/16; 28000 MB; global batch 1024; pipeline
micro-batch <= 8 in the search and the grid), each search stopping on convergence
(`--patience-trials` without a gain after a restart) instead of a trial budget, stage cuts at
any operator as the published search (`--granularity layer` for what --aceso-config runs).
Fields: model, gpus, memory_mb, ours_s, grid_s, speedup, ours_cpu_s, grid_cpu_s, trials,
restarts, config, granularity. With `--published-aceso DIR` also: ours_under_published_s (our
configuration as is), ours_refit_published_s (our layout, recompute chosen by the published
model), published_s, published_under_ours_s, published_refit_ours_s (its layout, our recompute
fit), each with whether it fits; ratio_ours_model / ratio_published_model = our time / the
published search's under that model, feasible configurations only (<= 1: ours is as fast);
cpu_ratio = ours_cpu_s / published_cpu_s (target <= 0.05).
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
from megatron.aceso.search import best_grid, refit_recompute, search_all  # noqa: E402

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


# --paper: the Aceso paper's settings (its search scripts, eurosys tables): GPUs by model size,
# 28000 MB, global batch 1024, pipeline micro-batch 1-8 for the search and the grid alike.
PAPER_SETUPS = [("gpt-350m", 1), ("gpt-1.3b", 4), ("gpt-2.6b", 8), ("gpt-6.7b", 16), ("gpt-13b", 32),
                ("t5-770m", 1), ("t5-3b", 4), ("t5-6b", 8), ("t5-11b", 16)]
PAPER_MEMORY_MB, PAPER_GBS, PAPER_MAX_MBS = 28000, 1024, 8


def run_paper(model, gpus, patience, include_allreduce, published_dir=None, published_budget=200,
              granularity="op"):
    """One --paper row: our search (stopping on convergence) and the grid, same space; with
    ``published_dir`` also the published search and each side's best under the other's model."""
    spec = get_model_spec(model)
    pm = PerfModel(OpDatabase(os.path.join(SHIPPED_DIR, "eurosys"), spec.family, spec.size), spec,
                   PAPER_MEMORY_MB, include_allreduce=include_allreduce)
    g0 = time.process_time()
    grid, _ = best_grid(pm, gpus, PAPER_GBS, max_micro_batch=PAPER_MAX_MBS)
    c0 = time.process_time()
    res = search_all(pm, gpus, PAPER_GBS, max_micro_batch=PAPER_MAX_MBS, patience_trials=patience,
                     granularity=granularity)
    cpu = time.process_time() - c0
    fit = [r for r in res if r.best.key[0] == 0]
    best = fit[0].best if fit else None
    published = next((p for d, m, *_, p in SETUPS if d == "eurosys" and m == model), None)
    row = _paper_row(model, gpus, patience, published, best, grid, cpu, c0 - g0, res)
    row["granularity"] = granularity
    if published_dir and best is not None:
        row.update(_published_columns(published_dir, pm, spec, best, gpus, published_budget, cpu))
    return row


def _published_columns(root, pm, spec, best, gpus, budget, cpu_ours=None):
    import tempfile

    import published_aceso as pub
    from megatron.aceso.config import load_plan, save_plan
    db = os.path.join(SHIPPED_DIR, "eurosys")
    ours_json = os.path.join(tempfile.mkdtemp(prefix="aceso_ours_"), "ours.json")
    save_plan(ours_json, best.plan, spec)
    ours_pub = pub.price(root, db, ours_json, gpus, PAPER_MEMORY_MB)
    # our layout with the recompute ops the published model picks for it (its memory rule)
    ours_refit = pub.price(root, db, ours_json, gpus, PAPER_MEMORY_MB, refit=True)
    out = {"ours_under_published_s": round(ours_pub["s"], 3),
           "ours_fits_published": ours_pub["memory_mb"] <= PAPER_MEMORY_MB,
           "ours_refit_published_s": round(ours_refit["s"], 3),
           "ours_refit_fits_published": ours_refit["memory_mb"] <= PAPER_MEMORY_MB,
           "published_budget_s": budget}
    path, cpu = pub.search(root, db, spec.family, spec.size, gpus, PAPER_GBS, PAPER_MEMORY_MB, budget)
    out["published_cpu_s"] = round(cpu, 2)
    if path is None:
        return {**out, "published_s": None}
    theirs = pub.price(root, db, path, gpus, PAPER_MEMORY_MB)
    plan = load_plan(path, pm.num_ops)
    pred = pm.predict(plan)
    refit = refit_recompute(pm, plan)  # the published layout with our recompute fit
    out.update({"published_s": round(theirs["s"], 3),
                "published_fits_published": theirs["memory_mb"] <= PAPER_MEMORY_MB,
                "published_under_ours_s": round(pred.iteration_ms / 1000, 3),
                "published_fits_ours": pred.fits,
                "published_refit_ours_s": round(refit.iteration_ms / 1000, 3),
                "published_refit_fits_ours": refit.fits})
    # feasible against feasible under each model (a side's own best, the other's refitted
    # layout): ours/published time ratio, <= 1 where our search's configuration is as fast
    ours_s = best.key[1] / 1000
    theirs_ours = min([refit.iteration_ms / 1000] + ([pred.iteration_ms / 1000] if pred.fits else []))
    ours_theirs = min([ours_refit["s"]] + ([ours_pub["s"]] if out["ours_fits_published"] else []))
    if refit.fits:
        out["ratio_ours_model"] = round(ours_s / theirs_ours, 4)
    if out["ours_refit_fits_published"] and out["published_fits_published"]:
        out["ratio_published_model"] = round(ours_theirs / theirs["s"], 4)
    if cpu_ours is not None and cpu > 0:
        out["cpu_ratio"] = round(cpu_ours / cpu, 4)
    return out


def _paper_row(model, gpus, patience, published, best, grid, cpu, grid_cpu, res):
    return {"model": model, "gpus": gpus, "memory_mb": PAPER_MEMORY_MB, "global_batch": PAPER_GBS,
            "published": published,
            "max_micro_batch": PAPER_MAX_MBS, "patience_trials": patience,
            "ours_s": round(best.key[1] / 1000, 3) if best else None,
            "grid_s": round(grid.key[1] / 1000, 3) if grid else None,
            "speedup": round(grid.key[1] / best.key[1], 3) if grid and best else None,
            "ours_cpu_s": round(cpu, 2), "grid_cpu_s": round(grid_cpu, 2),
            "trials": sum(r.trials for r in res), "restarts": sum(r.restarts for r in res),
            "config": None if best is None else {
                "micro_batch": best.plan.micro_batch, "gpus": [st.gpus for st in best.plan.stages],
                "tp": [st.tp for st in best.plan.stages], "dp": [st.dp for st in best.plan.stages],
                "ops": [st.end - st.start for st in best.plan.stages],
                "recompute_ops": [sum(st.flags()) for st in best.plan.stages]}}


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
    ap.add_argument("--granularity", choices=["layer", "op"], default=None,
                    help="stage cuts on layer boundaries (what --aceso-config runs) or anywhere (the "
                         "published search's space); default: layer, op with --paper")
    ap.add_argument("--paper", action="store_true",
                    help="the Aceso paper's settings: GPUs by model size, 28000 MB, global batch 1024, "
                         "pipeline micro-batch <= 8; the search stops on convergence (--patience-trials)")
    ap.add_argument("--patience-trials", type=int, default=300,
                    help="--paper: stop a stage count's search once restarts ran this many trials "
                         "without improving its best")
    ap.add_argument("--published-aceso", default=None, metavar="DIR",
                    help="--paper: a checkout of the published Aceso code (search/, profiler/); adds its "
                         "search's best and each side's best priced by the other's model")
    ap.add_argument("--published-budget", type=int, default=200,
                    help="--published-aceso: the published search's --time-budget-total (s per stage count)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    if args.paper:
        for model, gpus in PAPER_SETUPS:
            if only and model not in only and f"eurosys:{model}" not in only:
                continue
            print(json.dumps(run_paper(model, gpus, args.patience_trials, not args.no_allreduce,
                                       args.published_aceso, args.published_budget,
                                       args.granularity or "op")), flush=True)
        return
    for dbset, model, gpus, mem, gbs, pub in SETUPS:
        if only and f"{dbset}:{model}" not in only:
            continue
        print(json.dumps(run(dbset, model, gpus, mem, gbs, pub, args.budget_trials,
                             not args.no_allreduce, args.granularity or "layer")), flush=True)


if __name__ == "__main__":
    main()
