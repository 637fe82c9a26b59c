"""DynaPipe with and without TeraPipe token slices: simulated iteration time, GPT-6.7B
(cost_models/gpt_6.7b_a100.json), 8 GPUs as PP4 x DP2 and PP8 x DP1, 36,000 MB per GPU, global
batches of 65,536 tokens drawn from bench_planner's multi-task mixture (the heavy-tailed one:
its long samples reach the max length). One JSON object per line per (max length, layout):

  max_len, layout                 the setting
  dynapipe_ms                     mean simulated iteration time of DynaPipe alone ("inf": some batch
                                  fits no plan: a sample past the table's 8192 tokens, or memory)
  sliced_ms                       the same batches with --terapipe-slices auto (dynapipe_slicing.py)
  postpass_only_ms                sliced, but only DynaPipe's own partitions are sliced (no partition cut
                                  with sliced costs): the post-pass alone
  speedup                         dynapipe_ms / sliced_ms
  sliced_fraction                 batches whose chosen plan runs token slices
  planning_s_dynapipe / _sliced   mean planning wall time per batch (one thread)

    python benchmarks/bench_dynapipe_slicing.py [--max-lens 4096,8192,16384] [--batches 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_planner import make_batches  # noqa: E402
from megatron.experiments.slicing import planner_for  # noqa: E402
from megatron.planner.dynapipe import slicing as dynapipe_slicing  # noqa: E402
from megatron.planner.dynapipe.planner import PlanningError  # noqa: E402


def _run(planner, batches):
    times, sliced, t0 = [], 0, time.perf_counter()
    for b in batches:
        try:
            p = planner.plan(b, validate=False)
        except PlanningError:
            times.append(np.inf)
            continue
        times.append(p.makespan_ms)
        sliced += p.groups[0].token_slices is not None
    return float(np.mean(times)), sliced / len(batches), (time.perf_counter() - t0) / len(batches)


def _fmt(x):
    return round(x, 1) if np.isfinite(x) else "inf"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-lens", default="4096,8192,16384")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--mixture", default="multitask")
    args = ap.parse_args(argv)
    for L in [int(x) for x in args.max_lens.split(",")]:
        batches = make_batches("gpt", L, 65536, args.batches, seed=1000 + L, mixture=args.mixture)
        for pp, dp in ((4, 2), (8, 1)):
            base, _, t_base = _run(planner_for(pp, dp), batches)
            sliced, frac, t_sliced = _run(planner_for(pp, dp, -1), batches)
            keep = dynapipe_slicing.SLICED_COST_PARTITIONS
            dynapipe_slicing.SLICED_COST_PARTITIONS = False
            try:
                post, _, _ = _run(planner_for(pp, dp, -1), batches)
            finally:
                dynapipe_slicing.SLICED_COST_PARTITIONS = keep
            print(json.dumps({"benchmark": "dynapipe_slicing", "max_len": L, "layout": f"PP{pp}xDP{dp}",
                              "batches": len(batches), "dynapipe_ms": _fmt(base), "sliced_ms": _fmt(sliced),
                              "postpass_only_ms": _fmt(post),
                              "speedup": round(base / sliced, 3) if np.isfinite(sliced) and np.isfinite(base) else None,
                              "sliced_fraction": frac, "planning_s_dynapipe": round(t_base, 2),
                              "planning_s_sliced": round(t_sliced, 2)}), flush=True)


if __name__ == "__main__":
    main()
