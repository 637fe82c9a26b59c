"""DynaPipe against packing with per-document attention, measured on CPU beside the simulator.

pretrain_gpt.py on 2 CPU ranks (PP=2, gloo, one thread each), tiny GPT (4 layers, hidden 64,
4 heads, FFN 256: the model cost_models/cpu_tiny_gpt.json was profiled for, by the project's
own profiler on this kind of machine), the shipped multi-task data (data/cache/kjv_tasks_sp4k_*,
built by data/build_sample_data.sh), --seq-length 256, token-budget global batches. Three ways
to batch the same global batches:

* `dynapipe`: --dynapipe (padded micro-batches, the paper's planner);
* `dynapipe_packed_rows`: --dynapipe --dynapipe-packed-rows (DynaPipe may also choose
  micro-batches of packed rows);
* `pack_dataset`: --pack-dataset --micro-batch-size B (next-fit rows, per-document attention,
  1F1B: Megatron-Core-style packing).

Printed, one JSON object per configuration: measured step times (median of the iterations
after the first `--skip`; DynaPipe plans in-process, so its planning time is also subtracted:
`measured_minus_planning_ms_median`), and the simulator's prediction for the same iterations from the CPU
table: DynaPipe's own (`simulated_ms` in its log line), and for --pack-dataset the planner's
price of exactly the rows the trainer builds (`megatron.planner.dynapipe.packed`, 1F1B, no recompute).
`error` is predicted / (measured - planning) - 1 of the medians: the time model's error on
this machine (issue 25 asks for 20 %). A last object compares the orderings (`ordering_agrees`: predicted vs measured without
planning). Machine load moves the measured
numbers (shared 2-core box): compare the ordering, not the absolute values.

    nice -n 10 python benchmarks/bench_packing_cpu.py            # ~3-6 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.experiments.logparse import parse_log  # noqa: E402

DATA = ROOT / "data" / "cache" / "kjv_tasks_sp4k"
COST_MODEL = ROOT / "cost_models" / "cpu_tiny_gpt.json"
MEMORY_MB = 200.0
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--max-position-embeddings", "512"]


def ensure_data(python: str) -> None:
    if Path(f"{DATA}_targets_document.idx").is_file():
        return
    subprocess.run([python, "tools/preprocess_data.py", "--workers", "1", "--no-progress", "--input",
                    "data/multitask/kjv_tasks.jsonl.gz", "--tokenizer-type", "GPTSentencePieceTokenizer",
                    "--tokenizer-model", "data/tokenizers/kjv_sp4k.model", "--json-keys", "inputs", "targets",
                    "--append-eod", "--output-prefix", str(DATA)], cwd=ROOT, check=True)


def command(args, extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "pretrain_gpt.py"), *MODEL, "--pipeline-model-parallel-size", "2",
            "--seq-length", str(args.seq_length), "--tokens-per-global-batch", str(args.tokens),
            "--train-iters", str(args.iters), "--log-interval", "1", "--lr", "1e-3", "--split", "100,0,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "data/tokenizers/kjv_sp4k.model",
            "--data-path", f"{DATA}_inputs_document", "--targets-data-path", f"{DATA}_targets_document", *extra]


def train_rows(argv, name, timeout):
    """Run the trainer's command line (one thread per rank, loopback gloo) and return its parsed
    log rows; a failed or silent run stops the benchmark with the log's tail."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as log:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout).returncode
        log.seek(0)
        text = log.read()
    rows = parse_log(text)
    if rc != 0 or not rows:
        raise SystemExit(f"{name}: trainer exited with {rc}; log tail:\n" + "\n".join(text.splitlines()[-15:]))
    return rows


def run(args, name, extra):
    return train_rows(command(args, extra), name, args.timeout)


def planner_config(args, packed_rows):
    """The trainer's planner config (`supervised_training.dynapipe_planner_config`) for this run."""
    from megatron.planner.dynapipe.planner import DynaPipeConfig
    return DynaPipeConfig(cost_model_path=str(COST_MODEL), model_kind="gpt", hidden_size=64, num_layers=4,
                          pipeline_parallel=2, memory_limit_mb=MEMORY_MB, pad_multiple=8,
                          weight_grad_bytes_per_param=8.0, optimizer_bytes_per_param=8.0, zero_shards=1,
                          emit_plans=False, packed_rows=packed_rows, packed_max_len=args.seq_length)


def pack_dataset_predictions(args, iterations):
    """Simulated 1F1B time of the rows --pack-dataset builds for each global batch."""
    from megatron.data.supervised_dataset import build_supervised_datasets
    from megatron.planner.dynapipe import packed
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    from megatron.training.supervised import global_batch_bounds
    train, _, _ = build_supervised_datasets([f"{DATA}_inputs_document"], [f"{DATA}_targets_document"], "100,0,0")
    lengths = np.minimum(train.input_lengths + train.target_lengths - 1, args.seq_length).clip(min=1)
    cfg = SimpleNamespace(model=SimpleNamespace(seq_length=args.seq_length),
                          data=SimpleNamespace(tokens_per_global_batch=args.tokens))
    bounds = global_batch_bounds(cfg, lengths, 0, iterations)
    planner = DynaPipePlanner(planner_config(args, False))
    out = []
    for k in range(iterations):
        batch = lengths[bounds[k]:bounds[k + 1]].tolist()
        rows = packed.next_fit("gpt", batch, args.seq_length)
        mbs = [rows[i:i + args.micro_batch_size] for i in range(0, len(rows), args.micro_batch_size)]
        sh = packed.shapes_of(planner, "gpt", batch, args.seq_length, mbs)
        # (with the calibrated step overhead, as DynaPipe reports its plans)
        out.append(packed.one_f_one_b_time(planner, "none", sh, packed.contiguous_groups(len(mbs), 1)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096, help="--tokens-per-global-batch")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first iterations not timed (start-up)")
    ap.add_argument("--micro-batch-size", type=int, default=2, help="--pack-dataset rows per micro-batch")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.iters <= args.skip:
        ap.error("--iters must exceed --skip")
    ensure_data(sys.executable)
    dyn_flags = ["--dynapipe", "--dynapipe-cost-model", str(COST_MODEL), "--dynapipe-memory-limit",
                 f"{MEMORY_MB:g}", "--dynapipe-planner-workers", "0"]
    configs = {
        "dynapipe": dyn_flags,
        "dynapipe_packed_rows": dyn_flags + ["--dynapipe-packed-rows"],
        "pack_dataset": ["--pack-dataset", "--micro-batch-size", str(args.micro_batch_size)],
    }
    pack_pred = pack_dataset_predictions(args, args.iters)
    results = {}
    for name, extra in configs.items():
        rows = run(args, name, extra)
        timed = [r for r in rows if r["iteration"] > args.skip]
        measured = [r["elapsed_ms"] for r in timed]
        if name == "pack_dataset":
            predicted = [pack_pred[r["iteration"] - 1] for r in timed]
            planning = [0.0] * len(timed)
        else:
            predicted = [r["planner"]["simulated_ms"] for r in timed]
            # the wall time the step waited for its plan (planning + lowering, in-process)
            planning = [r["planner"].get("plan_wait_ms") or 0.0 for r in timed]
        # With --dynapipe-planner-workers 0 every rank plans in-process inside the step; a job
        # plans ahead on other cores (the plan service), so the step without it is reported too.
        step = [m - p for m, p in zip(measured, planning)]
        res = {"benchmark": "packing_cpu", "config": name, "iterations": [r["iteration"] for r in timed],
               "measured_ms": measured, "planning_ms": planning, "predicted_ms": [round(p, 2) for p in predicted],
               "measured_ms_median": round(statistics.median(measured), 1),
               "measured_minus_planning_ms_median": round(statistics.median(step), 1),
               "predicted_ms_median": round(statistics.median(predicted), 2),
               # the time model's claim (issue 25: within 20 %) against the step without planning
               "error": round(statistics.median(predicted) / statistics.median(step) - 1, 3),
               "loss_last": timed[-1]["loss"]}
        results[name] = res
        print(json.dumps(res), flush=True)
    order = lambda key: sorted(results, key=lambda n: results[n][key])  # noqa: E731
    print(json.dumps({"benchmark": "packing_cpu_summary", "predicted_order": order("predicted_ms_median"),
                      "measured_order": order("measured_ms_median"),
                      "measured_minus_planning_order": order("measured_minus_planning_ms_median"),
                      "ordering_agrees": order("predicted_ms_median") == order("measured_minus_planning_ms_median"),
                      "seq_length": args.seq_length, "tokens_per_global_batch": args.tokens,
                      "cost_model": str(COST_MODEL.relative_to(ROOT))}), flush=True)


if __name__ == "__main__":
    main()
