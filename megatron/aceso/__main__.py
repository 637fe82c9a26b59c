"""``python -m megatron.aceso search|predict|grid`` — see megatron/aceso/search.py and model.py.

Examples::

    python -m megatron.aceso search --db megatron/aceso/data/miniset --model gpt-1.3b \\
        --gpus 4 --memory-gb 12 --global-batch 512 --budget-trials 500 --out-dir runs/aceso
    python -m megatron.aceso predict runs/aceso/best.json --db megatron/aceso/data/miniset \\
        --memory-gb 12
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from megatron.aceso.config import load_plan, save_plan
from megatron.aceso.db import SHIPPED_DIR, OpDatabase
from megatron.aceso.model import MODELS, ModelSpec, PerfModel, format_prediction, get_model_spec
from megatron.aceso.search import best_grid, search_all


def _perf_model(args, model_name):
    if getattr(args, "num_layers", None):  # a model of our own tables, e.g. gpt-tiny from `profile`
        family, size = model_name.split("-", 1)
        spec = ModelSpec(family, size, tuple(args.num_layers), 0, 0, args.global_batch or 1024)
    else:
        spec = get_model_spec(model_name)
    db = OpDatabase(args.db, spec.family, spec.size)
    return spec, PerfModel(db, spec, args.memory_gb * 1024, gpus_per_node=args.gpus_per_node,
                           include_allreduce=not args.no_allreduce)


def _common(p):
    p.add_argument("--db", default=os.path.join(SHIPPED_DIR, "eurosys"),
                   help="directory of Aceso-format CSV databases (default: shipped eurosys set)")
    p.add_argument("--memory-gb", type=float, default=30.0, help="per-device memory limit (GiB)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--no-allreduce", action="store_true",
                   help="leave the DP gradient all-reduce out of the iteration time (as Aceso does)")


def probe_host():
    """The 2 s host probe before profiling (profiling/noise.py; tests replace it)."""
    from megatron.profiling import noise
    return noise.probe()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m megatron.aceso")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("search", help="bottleneck-alleviation search, one per stage count")
    _common(s)
    s.add_argument("--model", required=True, help="e.g. gpt-1.3b, t5-770m; or <family>-<size> of "
                   "tables written by `profile`, with --num-layers")
    s.add_argument("--num-layers", type=int, nargs="+", default=None,
                   help="layers per layer kind for a model not in the built-in list (T5: enc dec)")
    s.add_argument("--gpus", type=int, required=True)
    s.add_argument("--global-batch", type=int, default=None,
                   help="samples per iteration (default: the model's published 1024)")
    s.add_argument("--budget-trials", type=int, default=None,
                   help="evaluated configurations per stage count (deterministic)")
    s.add_argument("--budget-seconds", type=float, default=None, help="wall seconds per stage count")
    s.add_argument("--max-stages", type=int, default=16)
    s.add_argument("--max-hops", type=int, default=7)
    s.add_argument("--jobs", type=int, default=1, help="stage counts searched in parallel processes")
    s.add_argument("--top", type=int, default=3, help="configs written to --out-dir")
    s.add_argument("--granularity", choices=["layer", "op"], default="layer",
                   help="where stages may be cut: layer boundaries (runnable) or any operator (Aceso)")
    s.add_argument("--runnable", action="store_true",
                   help="only configurations --aceso-config can run: stage cuts on layer boundaries, "
                        "only layer operators recomputed (stages may still differ in TP and DP)")
    s.add_argument("--out-dir", default=None)
    g = sub.add_parser("grid", help="best Megatron uniform configuration under the same model")
    _common(g)
    g.add_argument("--model", required=True)
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--global-batch", type=int, default=None)
    pr = sub.add_parser("predict", help="per-stage breakdown of an Aceso JSON config")
    _common(pr)
    pr.add_argument("config")
    pf = sub.add_parser("profile", help="profile our GPT layer on this device (TP 1) into op tables")
    pf.add_argument("--out", required=True, help="directory for gpt_<size>_mbs<M>_tp1_algo0.csv")
    pf.add_argument("--size", required=True, help="name in the file names, e.g. tiny")
    pf.add_argument("--num-layers", type=int, default=2)
    pf.add_argument("--hidden-size", type=int, required=True)
    pf.add_argument("--num-attention-heads", type=int, required=True)
    pf.add_argument("--seq-length", type=int, required=True)
    pf.add_argument("--vocab-size", type=int, required=True)
    pf.add_argument("--mbs", type=int, nargs="+", default=[1, 2, 4])
    pf.add_argument("--repeats", type=int, default=5)
    pf.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads while profiling (default 1, as each rank of a CPU job whose ranks share "
                         "the cores)")
    pf.add_argument("--max-spread", type=float, default=0.5,
                    help="an operator whose repeats spread more ((median - min) / min) is re-measured, then refused: "
                         "no table is kept while one stays noisy (default %(default)s)")
    pf.add_argument("--remeasure", type=int, default=2, help="extra rounds for a noisy operator")
    pf.add_argument("--quiet", action="store_true", help="no per-operator progress lines")
    pf.add_argument("--min-share", type=float, default=None,
                    help="refuse at once when a 2 s host probe gets less of a core than this (default 0.6; 0 "
                         "profiles on any host)")
    args = ap.parse_args(argv)

    if args.cmd == "profile":
        from megatron.aceso.profiler import profile_gpt
        from megatron.config.core import ModelConfig
        cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                          vocab_size=args.vocab_size)
        from megatron.profiling import noise
        if args.repeats < 1 or args.cpu_threads < 1 or not args.max_spread > 0 or args.remeasure < 0:
            ap.error("profile: --repeats and --cpu-threads must be >= 1, --max-spread > 0, --remeasure >= 0")
        log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
        min_share = noise.MIN_SHARE if args.min_share is None else args.min_share
        if min_share > 0:
            host = probe_host()
            log(f"host probe: {host.describe()}")
            if host.share < min_share:
                print(f"python -m megatron.aceso profile: error: host too busy to profile ({host.describe()}; under "
                      f"--min-share {min_share:g} operators come out noisy and are refused after minutes): nothing "
                      "written. Run it on an idle host, or pass --min-share 0 to try anyway.", file=sys.stderr)
                return 1
        nl = noise.NoiseLog(args.max_spread)
        os.makedirs(args.out, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=args.out, prefix=".profiling-")  # tables land in --out only when quiet
        try:
            paths = profile_gpt(cfg, tmp, size=args.size, mbs_values=args.mbs, repeats=args.repeats,
                                threads=args.cpu_threads, max_spread=args.max_spread, remeasure=args.remeasure,
                                noise_log=nl, log=log)
            refusal = nl.refusal("python -m megatron.aceso profile")
            if refusal:
                print(refusal, file=sys.stderr)
                return 1
            for path in paths:
                final = os.path.join(args.out, os.path.basename(path))
                os.replace(path, final)
                print(f"wrote {final}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0

    if args.cmd == "predict":
        with open(args.config) as f:
            d = json.load(f)
        name = f"{d['model_name']}-{str(d['model_size']).replace('_', '.')}"
        if name.lower() not in MODELS:  # tables of our own profiler: layer counts from the file
            n = d["num_layers"]
            args.num_layers, args.global_batch = (n if isinstance(n, list) else [n]), None
        spec, pm = _perf_model(args, name)
        plan = load_plan(args.config, pm.num_ops)
        print(format_prediction(plan, pm.predict(plan)))
        return 0

    spec, pm = _perf_model(args, args.model)
    gbs = args.global_batch or spec.default_global_batch
    if args.cmd == "grid":
        best, n = best_grid(pm, args.gpus, gbs)
        if best is None:
            print(f"no uniform configuration fits {args.memory_gb} GB", file=sys.stderr)
            return 1
        print(f"{n} grid points; best:")
        print(format_prediction(best.plan, best.pred))
        return 0

    if args.budget_trials is None and args.budget_seconds is None:
        args.budget_trials = 500
    t0 = time.perf_counter()
    grid, _ = best_grid(pm, args.gpus, gbs)

    def progress(r):
        b = r.best
        desc = "no fit" if b is None or b.key[0] else f"{b.key[1] / 1000:.3f} s/iter"
        print(f"stages {r.num_stages:>2}: {desc}  ({r.trials} trials, {r.hops_accepted} hops, "
              f"{r.restarts} restarts, {r.seconds:.2f} s)", flush=True)

    results = search_all(pm, args.gpus, gbs, budget_trials=args.budget_trials,
                         budget_seconds=args.budget_seconds, max_stages=args.max_stages,
                         jobs=args.jobs, progress=progress, max_hops=args.max_hops,
                         runnable=args.runnable, granularity=args.granularity)
    fits = [r for r in results if r.best.key[0] == 0]
    if not fits:
        print(f"no configuration fits {args.memory_gb} GB", file=sys.stderr)
        return 1
    best = fits[0].best
    print(format_prediction(best.plan, best.pred))
    if grid is not None:
        print(f"best uniform grid: {grid.key[1] / 1000:.3f} s/iter; speed-up "
              f"{grid.key[1] / best.key[1]:.3f}x; search {time.perf_counter() - t0:.1f} s")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        for i, r in enumerate(fits[: args.top]):
            name = "best.json" if i == 0 else f"top{i + 1}_stages{r.num_stages}.json"
            save_plan(os.path.join(args.out_dir, name), r.best.plan, spec)
        print(f"wrote {min(args.top, len(fits))} configs to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
