"""TeraPipe: simulated iteration time with planned token slices vs micro-batch pipelining
without slices (GPT-6.7B, A100 per-layer table), the slice DP's planning time, and a measured
CPU run (PP=2, 2 ranks) of sliced vs unsliced training steps.

How to run (from the repository root):

    python benchmarks/bench_terapipe.py                 # simulation + CPU run (a few minutes on 2 cores)
    python benchmarks/bench_terapipe.py --no-cpu-run    # simulation only (seconds)

Output: one JSON object per line.

`"benchmark": "terapipe_simulated"` (one per PP x sequence length x batch):
  pp, layers, layers_per_stage, seq, batch    GPT-6.7B = 32 layers of hidden 4096 (cost_models/gpt_6.7b_a100.json,
                                              TP=1), `batch` sequences per iteration (per pipeline)
  baseline_ms, baseline_mbs                   micro-batch pipelining without slices (1F1B; GPipe has the same
                                              makespan): (m + K - 1) * t_stage(b, seq, 0) with m = batch / b,
                                              best micro-batch size b whose table entry exists (the table marks
                                              out-of-memory shapes)
  terapipe_ms, terapipe_mbs, slices           `plan_batch`: best micro-batch size and slicing (DP over slicings
                                              on the 8-token grid; exact up to 1024 tokens, caps 0.1 % apart
                                              beyond), m * n units back to back:
                                              sum t_i + (K - 1) max t_i
  speedup                                     baseline_ms / terapipe_ms
  planning_ms                                 wall time of `plan_batch` for this row (one slice DP per micro-batch
                                              size dividing the batch, warm process)
  per_sequence_dp_ms                          the slice DP alone for the chosen micro-batch size
  groups_ms, groups, groups_vs_equal          the published two-level DP (megatron/planner/terapipe/groups.py):
                                              uneven groups of sequences, each with its own slicing; `groups`
                                              lists [sequences, slices] per group; groups_vs_equal = terapipe_ms /
                                              groups_ms (>= 1: equal micro-batches are one of its candidates)
  groups_planning_ms                          its wall time (it runs plan_batch first, for the pruning bound)
Memory is not constrained on either side beyond the table's own out-of-memory entries (GPipe-order
TeraPipe keeps every unit's activations and K/V; at 8192 tokens that exceeds 40 GB without
recomputation, as it does for the unsliced baseline with more than a few micro-batches in flight).
t_stage comes from `terapipe_latency.from_cost_model`: t(b, l, 0) read from the table, context
term a3 * b * l * c derived from the table's quadratic term (see that module), plus two
activation transfers at 25 GB/s. Simulated, not measured: no A100 was used.

`"benchmark": "terapipe_cpu"`: pretrain_gpt.py on 2 CPU ranks (PP=2), mock data, the same
model and batch with and without --terapipe; median iteration time of the timed iterations
(first two skipped), the final loss of each (equal up to fp32 rounding: the runs compute the
same thing).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.planner.cost.cost_model import CostModel  # noqa: E402
from megatron.planner.terapipe.lowering import plan_batch, slice_memory_mb  # noqa: E402
from megatron.planner.terapipe.groups import plan_batch_groups  # noqa: E402
from megatron.planner.terapipe.latency import from_cost_model  # noqa: E402

LAYERS, HIDDEN, HEADS = 32, 4096, 32
MEM_LIMIT_MB = 36000.0


def simulate(pp: int, seq: int, batch: int, lat) -> dict:
    lps = LAYERS // pp
    stage = lambda b, l, c: lat.stage_ms(b, l, c, lps)  # noqa: E731
    base = None
    for b in range(1, batch + 1):
        if batch % b:
            continue
        t = stage(b, seq, 0)
        if t == float("inf"):
            continue
        ms = (batch // b + pp - 1) * t
        if base is None or ms < base[0]:
            base = (ms, b)
    t0 = time.perf_counter()
    b, sp = plan_batch(batch, seq, pp, stage, vectorized=True)  # exact <= 1024 tokens, caps 0.1 % apart beyond
    planning_ms = (time.perf_counter() - t0) * 1e3
    groups = plan_batch_groups(batch, seq, pp, stage, vectorized=True)
    row = {"benchmark": "terapipe_simulated", "pp": pp, "layers": LAYERS, "layers_per_stage": lps, "seq": seq,
           "batch": batch, "baseline_ms": None if base is None else round(base[0], 2),
           "baseline_mbs": None if base is None else base[1], "terapipe_ms": round(sp.score, 2),
           "terapipe_mbs": b, "num_slices": len(sp.slices), "slices": sp.slices,
           "speedup": None if base is None else round(base[0] / sp.score, 3),
           "planning_ms": round(planning_ms, 1), "per_sequence_dp_ms": round(sp.planning_s * 1e3, 1),
           "groups_ms": round(groups.score, 2), "groups": [[g, len(s)] for g, s in groups.groups],
           "groups_vs_equal": round(sp.score / groups.score, 5),
           "groups_planning_ms": round(groups.planning_s * 1e3, 1)}
    return row


def cpu_run(terapipe: bool, iters: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
           "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "128",
           "--num-attention-heads", "4", "--seq-length", "512", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--train-iters", str(iters), "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--mock-data", "--vocab-size", "512", "--log-interval", "1", "--eval-interval", "100000",
           "--eval-iters", "0"]
    if terapipe:
        cmd += ["--terapipe", "--terapipe-slices", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    loss = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out.stdout)]
    slices = re.findall(r"token slices: (\[[^\]]*\])", out.stdout)
    return {"iter_ms_median": round(statistics.median(ms[2:]), 1), "iters_timed": len(ms[2:]),
            "final_loss": loss[-1], "slices": slices[-1] if slices else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-cpu-run", action="store_true")
    p.add_argument("--cpu-iters", type=int, default=8)
    a = p.parse_args(argv)
    lat = from_cost_model(CostModel.load(ROOT / "cost_models" / "gpt_6.7b_a100.json"))
    import numpy as np
    np.seterr(invalid="ignore")  # the table interpolation multiplies inf (out-of-memory cells) by 0 weights
    simulate(8, 2048, 1, lat)  # warm-up (numpy lazy imports)
    for pp in (4, 8):
        for seq in (2048, 8192):
            for batch in (1, 2, 4, 8):
                print(json.dumps(simulate(pp, seq, batch, lat)), flush=True)
    if not a.no_cpu_run:
        plain = cpu_run(False, a.cpu_iters)
        sliced = cpu_run(True, a.cpu_iters)
        print(json.dumps({"benchmark": "terapipe_cpu", "pp": 2, "seq": 512, "batch": 2, "micro_batch_size": 1,
                          "hidden": 128, "layers": 4, "cores": len(os.sched_getaffinity(0)),
                          "unsliced_1f1b": plain, "terapipe_4_slices": sliced,
                          "measured_speedup": round(plain["iter_ms_median"] / sliced["iter_ms_median"], 3)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
