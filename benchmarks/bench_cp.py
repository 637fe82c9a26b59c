"""When do token slices beat context parallelism? Simulated iteration time of GPT-6.7B on the
A100 table (cost_models/gpt_6.7b_a100.json), 8 and 16 GPUs, 36,000 MB per GPU, global batches
of 65,536 tokens (at least 2 sequences) from bench_planner's heavy-tailed multi-task mixture
capped at each max length (`--lengths multitask`; few samples reach it), or of max-length
sequences only (`--lengths fixed`). One JSON object per line per (max length, GPUs, system):

  cp               Megatron with context parallelism: the better of packed rows of max length
                   (next-fit) and padded micro-batches of samples, 1F1B, CP in {2, 4, 8} (megatron/planner/cost/cp_cost.py;
                   flash-kernel memory: no score matrix kept, see there)
  terapipe         TeraPipe alone: the same packed rows cut into token slices (its slice DP)
  dynapipe_slices  DynaPipe cutting its micro-batches into token slices
  dynapipe_cp      DynaPipe planning micro-batches for a static CP group
  packing          packed rows, no CP, no slices
  dynapipe         DynaPipe alone

Each system gets its best layout: PP in {1, 2, 4, 8} (TP 1), the remaining GPUs as DP (x CP);
`ms` is the mean simulated iteration time (inf: some batch fits no plan), `tokens_per_s` the
throughput, `layout` the winner, `comm` the K/V exchange (`--comm p2p|all_gather`). No A100
was used: every number comes from the table and the simulator.

    python benchmarks/bench_cp.py [--max-lens 8192,16384,32768,65536] [--gpus 8,16] [--batches 1]
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
from megatron.experiments.slicing import planner_for, terapipe_time  # noqa: E402
from megatron.planner.dynapipe.baselines import baselines  # noqa: E402
from megatron.planner.cost.cp_cost import cp_planner  # noqa: E402
from megatron.planner.dynapipe.planner import PlanningError  # noqa: E402

SYSTEMS = ("cp", "terapipe", "dynapipe_slices", "dynapipe_cp", "packing", "dynapipe")
TOKENS = 65536


def _plan(planner, batch) -> float:
    try:
        return float(planner.plan(batch, validate=False).makespan_ms)
    except (PlanningError, ValueError):
        return np.inf


def _packing(planner, batch, max_len, names=("packing",)) -> float:
    got = baselines(planner, "gpt", batch, max_len, names=names)
    return float(min(got[n][0] for n in names))


def candidates(system: str, gpus: int, comm: str, flash: bool = True):
    """(layout name, fn(batch, max_len) -> ms) for every layout the system may take."""
    for pp in (1, 2, 4, 8):
        dp = gpus // pp
        if system in ("cp", "dynapipe_cp"):
            for cp in (2, 4, 8):
                if dp % cp:
                    continue
                name = f"PP{pp}xDP{dp // cp}xCP{cp}"
                if system == "cp":
                    yield name, (lambda b, L, pp=pp, dp=dp, cp=cp: _packing(cp_planner(planner_for(pp, dp).cfg, cp, comm, flash), b, L,
                                                                             ("packing", "fixed")))
                else:
                    yield name, (lambda b, L, pp=pp, dp=dp, cp=cp: _plan(cp_planner(planner_for(pp, dp).cfg, cp, comm, flash), b))
        elif system == "terapipe":
            yield f"PP{pp}xDP{dp}", (lambda b, L, pp=pp, dp=dp: terapipe_time(planner_for(pp, dp, -1), b, L))
        elif system == "dynapipe_slices":
            yield f"PP{pp}xDP{dp}", (lambda b, L, pp=pp, dp=dp: _plan(planner_for(pp, dp, -1), b))
        elif system == "packing":
            yield f"PP{pp}xDP{dp}", (lambda b, L, pp=pp, dp=dp: _packing(planner_for(pp, dp), b, L))
        else:
            yield f"PP{pp}xDP{dp}", (lambda b, L, pp=pp, dp=dp: _plan(planner_for(pp, dp), b))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-lens", default="8192,16384,32768,65536")
    ap.add_argument("--gpus", default="8,16")
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--comm", default="p2p", choices=["p2p", "all_gather"])
    ap.add_argument("--lengths", default="multitask", choices=["multitask", "fixed"],
                    help="multitask: the heavy-tailed mix capped at the max length (few samples reach it); "
                         "fixed: every sequence is max-length (at least 2 per batch)")
    ap.add_argument("--cp-memory", default="flash", choices=["flash", "table"],
                    help="CP activation memory: flash kernel (no scores kept) or the table's score memory, as the "
                         "slices and DynaPipe are priced")
    args = ap.parse_args(argv)
    for L in [int(x) for x in args.max_lens.split(",")]:
        if args.lengths == "fixed":  # every sequence exactly L tokens: what "tokens per sequence" means
            batches = [[L] * max(2, TOKENS // L)] * args.batches
        else:
            batches = make_batches("gpt", L, max(TOKENS, 2 * L), args.batches, seed=1000 + L, mixture="multitask")
        tokens = float(np.mean([sum(int(x) for x in b) for b in batches]))
        for gpus in [int(x) for x in args.gpus.split(",")]:
            for system in args.systems.split(","):
                t0, best = time.perf_counter(), (np.inf, None)
                for name, fn in candidates(system, gpus, args.comm, args.cp_memory == "flash"):
                    try:  # a layout whose model states alone overflow memory has no plan
                        ms = float(np.mean([fn(b, L) for b in batches]))
                    except (PlanningError, ValueError):
                        ms = np.inf
                    if ms < best[0]:
                        best = (ms, name)
                ms, layout = best
                print(json.dumps({"benchmark": "cp_vs_slices", "lengths": args.lengths, "max_len": L, "gpus": gpus,
                                  "system": system,
                                  "comm": args.comm if system in ("cp", "dynapipe_cp") else None,
                                  "cp_memory": args.cp_memory if system in ("cp", "dynapipe_cp") else None,
                                  "ms": round(ms, 1) if np.isfinite(ms) else "inf", "layout": layout,
                                  "tokens_per_s": round(tokens / ms * 1e3) if np.isfinite(ms) else 0,
                                  "search_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
