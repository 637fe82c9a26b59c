"""Zero-bubble schedules on CPU: the measured step ordering of 1F1B, ZB-H1 and ZB-H2 next to
the simulator's, on 2 or 4 gloo ranks.

How to run (from the repository root; a few minutes on 2 cores):

    python benchmarks/bench_zb_cpu.py                 # PP=2 and PP=4
    python benchmarks/bench_zb_cpu.py --pp 2 --iters 2

Every pipeline rank is its own process (gloo on 127.0.0.1, one intra-op thread), TP=DP=1, mock
GPT data (bench_pipeline.py's workload). The executor records one Chrome-trace event per
instruction (`PipelineExecutor.trace_events`) in the timed iterations. From them:

  measured_ms            median over timed iterations of the latest compute end over all ranks
                         (every rank starts the iteration after a barrier, its clock at 0 there)
  op_ms                  per stage, median time of F, of a whole B (1F1B) or of its I and W halves
  simulated_ms           `megatron.planner.schedule.simulator.simulate` of the same per-rank orders with
                         op_ms as costs and no transfer time: what the clock should show if
                         the ranks ran in parallel
  order_agreement        over all pairs of compute ops on different ranks, the fraction whose
                         measured start times are in the simulated order (1.0: the same step
                         ordering); pairs the simulation starts at the same time are skipped
  idle_fraction_measured / _simulated   per rank, 1 - busy / makespan (the bubbles)
  w_over_b               the split's W time over the whole backward measured under 1F1B
                         (how much work the split leaves movable) - the executor's W walks the
                         graph again, so I + W exceeds B: see split_overhead
  split_overhead         (I + W) / B per stage
  cores, oversubscribed  with more ranks than cores the ranks time-slice: the clock then sees
                         the sum of the ranks' work, not bubbles

Summary per PP: measured and simulated speed-ups of ZB-H1 / ZB-H2 over 1F1B.

`--split-cost` (one process, no pipeline): the cost of the split itself on a GPT last stage
(the bench's width, `--layers` layers, output layer and loss): the whole backward against the
input pass plus the weight pass (`megatron/pipeline/split_backward.py`), and against the input
pass plus the whole-graph walk the executor falls back to; medians of alternating repeats, so
a change in machine load hits all three alike ("benchmark": "zero_bubble_split_cost").
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from datetime import timedelta

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipeline import available_cores, gpt_config  # noqa: E402
from megatron.core.launch import run_ranks  # noqa: E402
from megatron.pipeline.lowering import ComputeOp  # noqa: E402
from megatron.planner.schedule.simulator import PipelineCosts, simulate  # noqa: E402
from megatron.planner.schedule.static import static_orders  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-h2")          # the default set
ALL_SCHEDULES = SCHEDULES + ("zb-v", "dualpipev")  # V ones: two stages per rank


def _rank_main(rank, world, cfg, warmup, iters, timeout_s, device="cpu"):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    ps = initialize_model_parallel(1, world, timedelta(seconds=timeout_s))
    set_seeds(cfg.training.seed, ps, dev)
    trainer = build_gpt_trainer(cfg, ps, dev)
    traces = []
    for it in range(warmup + iters):
        events = [] if it >= warmup else None
        trainer.executor.trace_events = events
        dist.barrier()
        trainer.train_step()
        if dev.type == "cuda":  # the trace's host clock sees kernels only once they finished
            torch.cuda.synchronize(dev)
        if events is not None:
            traces.append([(e["name"][0], e["args"]["microbatch"], e["args"]["stage"], e["ts"] / 1e3, e["dur"] / 1e3)
                           for e in events if e["cat"] == "compute"])
    trainer.executor.trace_events = None
    return {"rank": rank, "traces": traces}


def _measure(schedule, pp, args):
    cfg = gpt_config(pp, schedule, None, hidden=args.hidden, heads=8, layers=args.layers, seq=args.seq,
                     vocab=1024, micro_batch_size=2, num_microbatches=args.microbatches,
                     train_iters=args.warmup + args.iters)
    cuda = getattr(args, "device", "cpu") == "cuda"   # NCCL, one GPU per rank
    ranks = run_ranks(_rank_main, pp, cfg, args.warmup, args.iters, 600.0, getattr(args, "device", "cpu"),
                      timeout_s=600.0, what="zb benchmark", backend="nccl" if cuda else "gloo",
                      start="spawn" if cuda else "fork")
    return [r["traces"] for r in sorted(ranks, key=lambda r: r["rank"])]


def _analyse(schedule, pp, m, traces, iters):
    # Executor trace kinds: F, B (whole or the input half of a split), W.
    split = schedule != "1f1b"
    orders, s2r = static_orders(schedule, m, pp, 2 if schedule in ("zb-v", "dualpipev") else 1)
    stages = len(s2r)
    per_it = []
    for it in range(iters):
        ops = {}
        for r in range(pp):
            for kind, mb, s, t0, dur in traces[r][it]:
                kind = "I" if split and kind == "B" else kind
                ops[ComputeOp(kind, mb, s)] = (t0, t0 + dur, r)
        per_it.append(ops)
    op_ms = {}
    for kind in ("F", "B", "I", "W"):
        got = [[statistics.median([ops[ComputeOp(kind, mb, s)][1] - ops[ComputeOp(kind, mb, s)][0] for ops in per_it])
                for mb in range(m)] for s in range(stages) if ComputeOp(kind, 0, s) in per_it[0]]
        if got:
            op_ms[kind] = np.array(got)
    orders = [[ComputeOp(o.kind, o.microbatch, o.stage) for o in order] for order in orders]
    z = np.zeros((stages, m))
    bwd = op_ms["B"] if not split else op_ms["I"] + op_ms["W"]
    costs = PipelineCosts(op_ms["F"], bwd, z + 1, z, z, wgrad=op_ms.get("W"))
    sim = simulate(costs, orders, s2r)
    ops = per_it[-1]
    pairs = agree = 0
    for a, b in itertools.combinations(list(ops), 2):
        if ops[a][2] == ops[b][2] or abs(sim.start[a] - sim.start[b]) < 1e-9:
            continue
        pairs += 1
        agree += (ops[a][0] < ops[b][0]) == (sim.start[a] < sim.start[b])
    measured = statistics.median(max(v[1] for v in o.values()) for o in per_it)

    def idle(starts_ends, makespan):
        busy = [0.0] * pp
        for r, (t0, t1) in starts_ends:
            busy[r] += t1 - t0
        return [round(1 - b / makespan, 3) for b in busy]
    return {
        "benchmark": "zero_bubble_cpu", "schedule": schedule, "stages": stages, "pp": pp, "microbatches": m,
        "cores": available_cores(), "oversubscribed": pp > available_cores(),
        "measured_ms": round(measured, 1), "simulated_ms": round(sim.makespan, 1),
        "op_ms": {k: [round(float(x), 2) for x in v.mean(axis=1)] for k, v in op_ms.items()},
        "order_agreement": round(agree / pairs, 3) if pairs else None,
        "idle_fraction_measured": idle([(v[2], v[:2]) for v in ops.values()], max(v[1] for v in ops.values())),
        "idle_fraction_simulated": idle([(s2r[o.stage], (sim.start[o], sim.end[o])) for o in sim.start], sim.makespan),
    }


def split_cost(args, repeats=7):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.models.gpt import GPTStage
    from megatron.pipeline.split_backward import WeightPlan
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = gpt_config(1, "1f1b", None, hidden=args.hidden, heads=8, layers=args.layers, seq=args.seq, vocab=1024,
                     micro_batch_size=2, num_microbatches=1, train_iters=1)
    ps = initialize_model_parallel(1, 1, timedelta(minutes=5))
    stage = GPTStage(cfg.model, ps, layer_start=0, layer_end=args.layers, pre_process=False, post_process=True, seed=1)
    b, s_, h = 2, args.seq, args.hidden
    batch = {"tokens": torch.randint(0, 1000, (b, s_)), "labels": torch.randint(0, 1000, (b, s_)),
             "loss_mask": torch.ones(b, s_), "position_ids": torch.arange(s_).expand(b, s_)}
    params = [p for p in stage.parameters() if p.requires_grad]

    def forward():
        x = torch.randn(s_, b, h, requires_grad=True)
        return x, stage(batch, [x])[0].sum()

    def whole():
        x, loss = forward()
        t0 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0

    def split(boundary):
        x, loss = forward()
        plan = WeightPlan.build([loss], [x], params)
        t0 = time.perf_counter()
        torch.autograd.grad(loss, x, retain_graph=True)
        plan.remove_hooks()
        t1 = time.perf_counter()
        if boundary:
            assert plan.run()
        else:
            loss.backward()
        return t1 - t0, time.perf_counter() - t1
    got = {"B": [], "I": [], "W": [], "W_walk": []}
    for k in range(repeats + 1):
        b_ms, (i_ms, w_ms), (_, walk_ms) = whole(), split(True), split(False)
        if k:  # the first round warms up
            for key, v in zip(got, (b_ms, i_ms, w_ms, walk_ms)):
                got[key].append(v * 1e3)
    med = {k: statistics.median(v) for k, v in got.items()}
    for p in params:
        p.grad = None
    return {"benchmark": "zero_bubble_split_cost", "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
            **{f"{k}_ms": round(v, 2) for k, v in med.items()},
            "split_over_whole": round((med["I"] + med["W"]) / med["B"], 3),
            "walk_fallback_over_whole": round((med["I"] + med["W_walk"]) / med["B"], 3),
            "w_share_of_backward": round(med["W"] / (med["I"] + med["W"]), 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=ALL_SCHEDULES)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--split-cost", action="store_true", help="only the in-process cost of the split itself")
    args = ap.parse_args(argv)
    if args.split_cost:
        print(json.dumps(split_cost(args)), flush=True)
        return
    for pp in args.pp:
        lines = {}
        for schedule in ["1f1b"] + [x for x in args.schedules if x != "1f1b"]:
            line = _analyse(schedule, pp, args.microbatches, _measure(schedule, pp, args), args.iters)
            lines[schedule] = line
            print(json.dumps(line), flush=True)
        b = lines["1f1b"]["op_ms"]["B"]
        zb = [x for x in lines if x != "1f1b"]
        for sch in [x for x in zb if len(lines[x]["op_ms"]["W"]) == len(b)]:  # V ones: 2 stages a rank
            o = lines[sch]["op_ms"]
            lines[sch]["w_over_b"] = [round(w / x, 3) for w, x in zip(o["W"], b)]
            lines[sch]["split_overhead"] = [round((i + w) / x, 3) for i, w, x in zip(o["I"], o["W"], b)]
        print(json.dumps({"benchmark": "zero_bubble_cpu_summary", "pp": pp, "cores": available_cores(),
                          **{f"measured_speedup_{s}": round(lines["1f1b"]["measured_ms"] / lines[s]["measured_ms"], 3)
                             for s in zb},
                          **{f"simulated_speedup_{s}":
                             round(lines["1f1b"]["simulated_ms"] / lines[s]["simulated_ms"], 3)
                             for s in zb},
                          **{f"{k}_{s}": lines[s][k] for s in zb for k in ("w_over_b", "split_overhead")
                             if k in lines[s]}}),
              flush=True)


if __name__ == "__main__":
    main()
