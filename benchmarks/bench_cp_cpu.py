"""DynaPipe with the CP size per micro-batch against a static CP group and against DynaPipe +
token slices, measured on 4 CPU ranks beside the simulator. (benchmarks/bench_cp.py prices static
CP on the A100 6.7B table; the CP size per micro-batch is built for PP 1, where 6.7B's model
states do not fit one GPU, so it is measured here on the CPU table.)

pretrain_gpt.py on 4 CPU ranks (gloo, one thread each), the tiny GPT of
cost_models/cpu_tiny_gpt.json, the shipped multi-task data (data/cache/kjv_tasks_sp4k_*, built on
first use as benchmarks/bench_packing_cpu.py does), the same token-budget global batches for all:

* `dynapipe_cp_variable`: --context-parallel-size 4 --dynapipe --dynapipe-cp-sizes 1,2,4 (each
  micro-batch at CP 1, 2 or 4 on a nested sub-group; short ones as extra data parallelism);
* `dynapipe_cp_static`: --context-parallel-size 4 --dynapipe (every micro-batch on all 4 ranks);
* `dynapipe_slices`: --pipeline-model-parallel-size 2 (x DP 2) --dynapipe --terapipe
  --terapipe-slices auto (DynaPipe cutting its micro-batches into token slices);
* `dynapipe_dp`: DP 4 --dynapipe (no CP, no slices: what CP 1 everywhere would be).

One JSON object per configuration: measured step times (median after `--skip`; plans are made
in-process, so the wait for the plan is subtracted: `measured_minus_planning_ms_median`) and the
simulator's prediction (`simulated_ms` of the planner's log line), then a summary comparing the
orderings. The box is shared: compare ratios and orderings, not absolute times.

    nice -n 10 python benchmarks/bench_cp_cpu.py            # ~5 minutes on 2 busy cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_packing_cpu import COST_MODEL, DATA, MODEL, ensure_data, train_rows  # noqa: E402

CONFIGS = {
    "dynapipe_cp_variable": ["--context-parallel-size", "4", "--dynapipe-cp-sizes", "1,2,4"],
    "dynapipe_cp_static": ["--context-parallel-size", "4"],
    "dynapipe_slices": ["--pipeline-model-parallel-size", "2", "--terapipe", "--terapipe-slices", "auto"],
    "dynapipe_dp": [],
}


def command(args, extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
            str(ROOT / "pretrain_gpt.py"), *MODEL, "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--tokens-per-global-batch", str(args.tokens),
            "--train-iters", str(args.iters), "--log-interval", "1", "--lr", "1e-3", "--split", "100,0,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "data/tokenizers/kjv_sp4k.model",
            "--data-path", f"{DATA}_inputs_document", "--targets-data-path", f"{DATA}_targets_document",
            "--dynapipe", "--dynapipe-cost-model", str(COST_MODEL), "--dynapipe-memory-limit", str(args.memory_mb),
            "--dynapipe-planner-workers", "0", *extra]


def run(args, name, extra):
    return train_rows(command(args, extra), name, args.timeout)


def _sum_counts(dicts):
    out = {}
    for d in dicts:
        for c, n in (d or {}).items():
            out[c] = out.get(c, 0) + n
    return out or None


def _pairs(results) -> dict:
    """For each pair of systems: is the predicted faster one also the measured faster one?"""
    names, out = list(results), {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = results[a]["predicted_ms_median"], results[b]["predicted_ms_median"]
            ma, mb = results[a]["measured_minus_planning_ms_median"], results[b]["measured_minus_planning_ms_median"]
            out[f"{a} vs {b}"] = {"predicted_ratio": round(pa / pb, 3), "measured_ratio": round(ma / mb, 3),
                                  "agrees": (pa < pb) == (ma < mb)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096, help="--tokens-per-global-batch")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2, help="first iterations not timed (start-up)")
    ap.add_argument("--memory-mb", type=float, default=200.0, help="--dynapipe-memory-limit")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.iters <= args.skip:
        ap.error("--iters must exceed --skip")
    ensure_data(sys.executable)
    results = {}
    for name in args.configs.split(","):
        rows = run(args, name, CONFIGS[name])
        timed = [r for r in rows if r["iteration"] > args.skip]
        measured = [r["elapsed_ms"] for r in timed]
        predicted = [r["planner"]["simulated_ms"] for r in timed]
        planning = [r["planner"].get("plan_wait_ms") or 0.0 for r in timed]
        step = [m - p for m, p in zip(measured, planning)]
        res = {"benchmark": "cp_cpu", "config": name, "iterations": [r["iteration"] for r in timed],
               "measured_ms": measured, "planning_ms": planning, "predicted_ms": [round(p, 2) for p in predicted],
               "measured_ms_median": round(statistics.median(measured), 1),
               "measured_minus_planning_ms_median": round(statistics.median(step), 1),
               "predicted_ms_median": round(statistics.median(predicted), 2),
               # micro-batches the plans ran at each CP size, summed over the timed iterations
               "cp_size_counts": _sum_counts(r["planner"].get("cp_size_counts") for r in timed),
               "loss_last": timed[-1]["loss"]}
        print(json.dumps(res), flush=True)
        results[name] = res
    order = lambda key: sorted(results, key=lambda n: results[n][key])  # noqa: E731
    base = results.get("dynapipe_cp_static")
    ratio = lambda key: None if base is None else {n: round(r[key] / base[key], 3)  # noqa: E731
                                                   for n, r in results.items()}
    print(json.dumps({"benchmark": "cp_cpu_summary", "predicted_order": order("predicted_ms_median"),
                      "measured_minus_planning_order": order("measured_minus_planning_ms_median"),
                      "ordering_agrees": order("predicted_ms_median") == order("measured_minus_planning_ms_median"),
                      # ratios to the static CP group (the box is shared: ratios, not absolute times)
                      "measured_vs_static_cp": ratio("measured_minus_planning_ms_median"),
                      "predicted_vs_static_cp": ratio("predicted_ms_median"),
                      "pairs": _pairs(results),
                      "seq_length": args.seq_length, "tokens_per_global_batch": args.tokens,
                      "cost_model": str(COST_MODEL.relative_to(ROOT))}), flush=True)


if __name__ == "__main__":
    main()
