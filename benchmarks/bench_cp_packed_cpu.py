"""DynaPipe + CP against CP over packed rows (the fair baseline), measured on 4 CPU ranks beside the simulator.

pretrain_gpt.py on 4 CPU ranks (PP 2 x CP 2, gloo, one thread each), the tiny GPT that
cost_models/cpu_tiny_gpt.json was profiled for, the shipped multi-task data (built on first use,
as benchmarks/bench_packing_cpu.py does), --seq-length 256, token-budget global batches:

* `pack_dataset_cp`: --pack-dataset --micro-batch-size B --context-parallel-size 2: next-fit
  packed rows of 256 tokens, per-document attention, 1F1B, the row cut into 2 x CP chunks
  (megatron/core/context_parallel.py): what a Megatron-Core user runs;
* `dynapipe_cp`: --dynapipe --context-parallel-size 2: DynaPipe's micro-batches of padded
  samples for the static CP group.

Printed, one JSON object per configuration: measured step times (median after `--skip`;
DynaPipe plans in-process, so its planning wait is subtracted too), and the simulator's
prediction: DynaPipe's own (its log line), and for the packed rows the fair baseline's price of
exactly the rows the trainer builds (megatron/planner/dynapipe/cp_baselines.py, the row's
chunks: `balance="row"`, recompute none). A last object says whether the simulator orders the
two as the clock does (`ordering_agrees`). The box is shared: compare the ordering, not the
absolute times.

    python benchmarks/bench_cp_packed_cpu.py [--iters 8]     # 4 timed iterations each, ~4 minutes on 2 shared cores
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_packing_cpu import COST_MODEL, DATA, MEMORY_MB, MODEL, ensure_data, planner_config, train_rows  # noqa: E402

CP = 2


def command(args, extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(2 * CP),
            str(ROOT / "pretrain_gpt.py"), *MODEL, "--pipeline-model-parallel-size", "2",
            "--context-parallel-size", str(CP),
            "--seq-length", str(args.seq_length), "--tokens-per-global-batch", str(args.tokens),
            "--train-iters", str(args.iters), "--log-interval", "1", "--lr", "1e-3", "--split", "100,0,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "data/tokenizers/kjv_sp4k.model",
            "--data-path", f"{DATA}_inputs_document", "--targets-data-path", f"{DATA}_targets_document", *extra]


def run(args, name, extra):
    t0 = time.perf_counter()
    print(f"[bench_cp_packed_cpu] {name}: training {args.iters} iterations on {2 * CP} ranks", file=sys.stderr,
          flush=True)
    rows = train_rows(command(args, extra), name, args.timeout)
    print(f"[bench_cp_packed_cpu] {name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def packed_cp_predictions(args, iterations):
    """The fair baseline's simulated 1F1B time of the rows --pack-dataset builds for each global
    batch, on the trainer's CP planner (`packed_cp_planner`: the trainer's DP 1 x CP 2)."""
    from megatron.data.supervised_dataset import build_supervised_datasets
    from megatron.planner.dynapipe import packed
    from megatron.planner.dynapipe.cp_baselines import packed_cp_planner, rank_quad
    from megatron.training.supervised import global_batch_bounds
    train, _, _ = build_supervised_datasets([f"{DATA}_inputs_document"], [f"{DATA}_targets_document"], "100,0,0")
    lengths = np.minimum(train.input_lengths + train.target_lengths - 1, args.seq_length).clip(min=1)
    cfg = SimpleNamespace(model=SimpleNamespace(seq_length=args.seq_length),
                          data=SimpleNamespace(tokens_per_global_batch=args.tokens))
    bounds = global_batch_bounds(cfg, lengths, 0, iterations)
    # cp_planner's config counts every rank of a stage as data parallel: DP 1 x CP 2 = 2
    planner = packed_cp_planner(dataclasses.replace(planner_config(args, False), data_parallel=CP), CP)
    out = []
    for k in range(iterations):
        batch = lengths[bounds[k]:bounds[k + 1]].tolist()
        rows = packed.next_fit("gpt", batch, args.seq_length)
        mbs = [rows[i:i + args.micro_batch_size] for i in range(0, len(rows), args.micro_batch_size)]
        sh = packed.shapes_of(planner, "gpt", batch, args.seq_length, mbs)
        sh.quad = (rank_quad("gpt", batch, args.seq_length, mbs, CP, "row"), sh.quad[1], sh.quad[2])
        out.append(packed.one_f_one_b_time(planner, "none", sh, packed.contiguous_groups(len(mbs), 1)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096, help="--tokens-per-global-batch")
    ap.add_argument("--iters", type=int, default=6, help="iterations per run (the first --skip untimed)")
    ap.add_argument("--skip", type=int, default=2, help="first iterations not timed (start-up)")
    ap.add_argument("--micro-batch-size", type=int, default=2, help="--pack-dataset rows per micro-batch")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.iters <= args.skip:
        ap.error("--iters must exceed --skip")
    ensure_data(sys.executable)
    configs = {
        "pack_dataset_cp": ["--pack-dataset", "--micro-batch-size", str(args.micro_batch_size)],
        "dynapipe_cp": ["--dynapipe", "--dynapipe-cost-model", str(COST_MODEL), "--dynapipe-memory-limit",
                        f"{MEMORY_MB:g}", "--dynapipe-planner-workers", "0"],
    }
    pack_pred = packed_cp_predictions(args, args.iters)
    results = {}
    for name, extra in configs.items():
        rows = run(args, name, extra)
        timed = [r for r in rows if r["iteration"] > args.skip]
        measured = [r["elapsed_ms"] for r in timed]
        if name == "pack_dataset_cp":
            predicted = [pack_pred[r["iteration"] - 1] for r in timed]
            planning = [0.0] * len(timed)
        else:
            predicted = [r["planner"]["simulated_ms"] for r in timed]
            planning = [r["planner"].get("plan_wait_ms") or 0.0 for r in timed]
        step = [m - p for m, p in zip(measured, planning)]
        res = {"benchmark": "cp_packed_cpu", "config": name, "cp": CP, "iterations": [r["iteration"] for r in timed],
               "measured_ms": measured, "planning_ms": planning, "predicted_ms": [round(p, 2) for p in predicted],
               "measured_ms_median": round(statistics.median(measured), 1),
               "measured_minus_planning_ms_median": round(statistics.median(step), 1),
               "predicted_ms_median": round(statistics.median(predicted), 2),
               "error": round(statistics.median(predicted) / statistics.median(step) - 1, 3),
               "loss_last": timed[-1]["loss"]}
        results[name] = res
        print(json.dumps(res), flush=True)
    order = lambda key: sorted(results, key=lambda n: results[n][key])  # noqa: E731
    print(json.dumps({"benchmark": "cp_packed_cpu_summary", "predicted_order": order("predicted_ms_median"),
                      "measured_minus_planning_order": order("measured_minus_planning_ms_median"),
                      "ordering_agrees": order("predicted_ms_median") == order("measured_minus_planning_ms_median"),
                      "predicted_speedup": round(results["pack_dataset_cp"]["predicted_ms_median"]
                                                 / results["dynapipe_cp"]["predicted_ms_median"], 3),
                      "measured_speedup": round(results["pack_dataset_cp"]["measured_minus_planning_ms_median"]
                                                / results["dynapipe_cp"]["measured_minus_planning_ms_median"], 3),
                      "seq_length": args.seq_length, "tokens_per_global_batch": args.tokens,
                      "cost_model": str(COST_MODEL.relative_to(ROOT))}), flush=True)


if __name__ == "__main__":
    main()
