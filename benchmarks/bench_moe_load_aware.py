"""Expert-load-aware DynaPipe against the load-blind plan, measured on CPU (issue 47, item 6).

    python benchmarks/bench_moe_load_aware.py [--iters 4] [--pairings 3] [--fixed 4,8] [--tokens 4096] [--seed 1]

About 4 minutes with the defaults on 2 shared cores (5 min 19 s with --iters 5 --pairings 4).

Two gloo ranks, EP 2 = DP 2, one pipeline stage: each rank runs its DP group's micro-batches
through `--layers` layers of (causal self-attention + the project's MoELayer with the alltoall
dispatcher, 4 experts of FFN width 1024, top-2: experts 0-1 on rank 0, 2-3 on rank 1), forward and backward, in
lockstep (the all-to-all pairs the ranks' i-th micro-batches).

Skewed routing, constructed deterministically: two tasks, A (long documents, 96-128 tokens)
and B (short, 16-48); every token of a task carries the task's direction +u / -u, and the
router's weights are +/- u (plus seeded noise), so A's tokens go to experts 0-1 (rank 0) and
B's to experts 2-3 (rank 1). Routing statistics are measured, not assumed: the routers' counts
per task on a probe batch (what the MoE layers log per step); a micro-batch's tokens per expert
= its padded length x k x each sample's task fractions (the padding repeats the sample's tokens).

Plans, from the same DynaPipe partition (cpu_tiny_gpt.json + MoE pricing, PP 1, DP 2):
* blind: DynaPipe's micro-batches in DynaPipe's order (every micro-batch priced at skew 1);
* aware: the same micro-batches re-paired by `expert_load.pair_by_load` (busiest rank).

Measured per plan, `--iters` rounds after a warm-up, the plans alternating: each rank's CPU
time of each step (thread time of its micro-batch's forward + backward; a barrier ends the
step), and `lockstep_cpu_ms` = sum over steps of the slowest rank's: the iteration's time when
each rank has a core of its own (minimum and median over the rounds). On a shared machine (2
cores, load average 30 when this was run) wall time cannot show a parallel speed-up, the ranks
take turns on the cores whether or not their work is balanced; wall_ms is printed too. Also
printed: the predicted ms (`expert_load.predict_ms`, each rank at the tokens its experts
receive), what the load-blind pricing believes, the steps' mean max/mean rank load, and the
ratios blind / aware.

The ordering check: `--pairings` random pairings of DynaPipe's
micro-batches, and (`--fixed`) fixed-size micro-batches in data order, blind and paired, priced
and run the same way; `ordering` lists the plans by predicted and by measured time and the share
of plan pairs the price orders as the clock does (Kendall's tau), over the pairings of DynaPipe's
micro-batches and over all plans. One JSON line; progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megatron.config.core import ModelConfig  # noqa: E402
from megatron.config.moe import MoEConfig  # noqa: E402
from megatron.models.moe.layer import MoELayer  # noqa: E402
from megatron.models.transformer import ParallelMLP  # noqa: E402
from megatron.planner.cost.moe_cost import MoEPricing  # noqa: E402
from megatron.planner.dynapipe import expert_load as el  # noqa: E402
from megatron.planner.dynapipe.config import DynaPipeConfig  # noqa: E402
from megatron.planner.dynapipe.planner import DynaPipePlanner  # noqa: E402

H, HEADS, FFN, E, K, EP = 64, 4, 256, 4, 2, 2
EXPERT_FFN = 1024  # experts 4x the table's FFN width: the expert GEMMs, which the skew slows, dominate


def log(msg):
    print(f"[bench_moe_load_aware] {msg}", file=sys.stderr, flush=True)


def make_batch(seed: int, tokens: int):
    """(lengths, task ids): A long, B short, B three times as frequent (equal token shares)."""
    rng = np.random.default_rng(seed)
    lengths, tasks, used = [], [], 0
    while used < tokens:
        t = int(rng.random() < 0.25)  # 1 = A
        n = int(rng.integers(96, 129) if t else rng.integers(16, 49))
        lengths.append(n)
        tasks.append(1 - t)  # task index: 0 = A, 1 = B
        used += n
    return np.array(lengths), np.array(tasks)


class Block(nn.Module):
    def __init__(self, cfg, ep_group, rank, i):
        super().__init__()
        g = torch.Generator().manual_seed(100 + i)
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)
        self.moe = MoELayer(cfg, None, ep_group=ep_group, ep_rank=rank, seed=7, key=f"l{i}", out_std=0.02,
                            layer_number=i, dense_mlp=ParallelMLP)
        u = torch.zeros(H)
        u[0] = 1.0
        with torch.no_grad():  # the skewed router: experts 0-1 along +u, 2-3 along -u
            w = 0.05 * torch.randn(E, H, generator=g)
            w[:E // 2] += 4.0 * u
            w[E // 2:] -= 4.0 * u
            self.moe.router.weight.copy_(w)

    def forward(self, x):  # [s, b, h]
        s, b, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, HEADS, H // HEADS).permute(2, 1, 3, 0, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, H)
        x = x + self.proj(a)
        return x + self.moe(self.ln2(x))


def inputs(lengths, tasks, mb, gen):
    """[s, b, h] for micro-batch `mb`: padded to its longest sample with the sample's own
    tokens (pad tokens route like the sample's, as `expert_load.Routing` without pad_frac counts them)."""
    s = int(max(lengths[i] for i in mb))
    x = 0.3 * torch.randn(s, len(mb), H, generator=gen)
    sign = torch.tensor([1.0 if tasks[i] == 0 else -1.0 for i in mb])
    x[:, :, 0] += 3.0 * sign
    return x


def worker(rank, args, port, plans, lengths, tasks, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=EP)
    cfg = ModelConfig(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                      moe=MoEConfig(num_experts=E, router_topk=K, ffn_hidden_size=EXPERT_FFN,
                                    token_dispatcher_type="alltoall", expert_model_parallel_size=EP))
    group = dist.new_group(list(range(EP)))
    model = nn.ModuleList([Block(cfg, group, rank, i) for i in range(args.layers)]).train()
    gen = torch.Generator().manual_seed(11 + rank)
    out = {"wall": {}, "lockstep": {}}
    for it in range(args.iters + 1):  # the first round warms up
        for name in plans:
            mbs = plans[name][rank]
            xs = [inputs(lengths, tasks, mb, gen) for mb in mbs]
            cpu = torch.zeros(len(xs), dtype=torch.float64)
            dist.barrier()
            t0 = time.perf_counter()
            for i, x in enumerate(xs):
                c0 = time.thread_time()
                h = x.requires_grad_(True)
                for blk in model:
                    h = blk(h)
                h.float().pow(2).mean().backward()
                cpu[i] = (time.thread_time() - c0) * 1e3
                dist.barrier()  # the step ends when every EP rank's micro-batch has
            wall = (time.perf_counter() - t0) * 1e3
            every = [torch.zeros_like(cpu) for _ in range(EP)]
            dist.all_gather(every, cpu)
            if it:
                out["wall"].setdefault(name, []).append(wall)
                out["lockstep"].setdefault(name, []).append(float(torch.stack(every).max(0).values.sum()))
        if rank == 0:
            log(f"round {it}/{args.iters}")
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4, help="measured rounds per plan (after one warm-up)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per global batch (both DP groups)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pairings", type=int, default=3,
                    help="random pairings of DynaPipe's micro-batches (ordering check)")
    ap.add_argument("--fixed", default="4,8", help="also run fixed-size micro-batches of these sizes (ordering check)")
    args = ap.parse_args(argv)
    args.fixed = [int(b) for b in args.fixed.split(",") if b]
    lengths, tasks = make_batch(args.seed, args.tokens)
    pricing = MoEPricing(num_experts=E, topk=K, expert_ffn=EXPERT_FFN, ep=EP, dispatcher="alltoall",
                         activation_bytes=4, a2a_gbps=1.0)
    cfg = DynaPipeConfig(cost_model_path=str(ROOT / "cost_models" / "cpu_tiny_gpt.json"), model_kind="gpt",
                         hidden_size=H, num_layers=args.layers, pipeline_parallel=1, data_parallel=2,
                         memory_limit_mb=1e6, schedules=("1f1b",), emit_plans=False, moe=pricing,
                         recompute_levels=("none",), activation_bytes=4)
    planner = DynaPipePlanner(cfg)
    plan = planner.plan(list(map(int, lengths)))
    got_counts = [len(g.microbatches) for g in plan.groups]
    # EP's lockstep exchange needs equal micro-batch counts per DP group (both plans get this)
    blind = el.equal_counts([g.microbatches for g in plan.groups])
    log(f"{len(lengths)} samples, DynaPipe: {got_counts} micro-batches per DP group, run as {len(blind[0])} each")
    port = 29500 + os.getpid() % 1000
    q = mp.get_context("spawn").SimpleQueue()
    # the routers' counts per task (the statistics a previous iteration's log gives)
    probe = _probe_counts(args)
    padded = planner._pad(lengths)
    st = el.class_routing(padded, tasks, probe, K)  # the padding repeats each sample's tokens
    aware = el.pair_by_load(blind, st, EP)
    plans = {"blind": blind, "aware": aware}
    shuffle = np.random.default_rng(args.seed)
    for k in range(args.pairings):  # the ordering check: DynaPipe's micro-batches, other pairings
        plans[f"random{k}"] = [blind[0], [blind[1][j] for j in shuffle.permutation(len(blind[1]))]]
    for b in args.fixed:  # and fixed-size micro-batches in data order, both pairings
        mbs = [list(range(i, min(i + b, len(lengths)))) for i in range(0, len(lengths), b)]
        fixed = el.equal_counts([mbs[0::2], mbs[1::2]])
        plans[f"fixed{b}_blind"], plans[f"fixed{b}_aware"] = fixed, el.pair_by_load(fixed, st, EP)
    mp.start_processes(worker, args=(args, port, plans, lengths, tasks, q), nprocs=EP, start_method="spawn")
    got = q.get()
    row = {"bench": "moe_load_aware", "ep": EP, "experts": E, "topk": K, "layers": args.layers,
           "samples": len(lengths), "tokens": int(lengths.sum()), "microbatches_per_group": len(blind[0]),
           "dynapipe_microbatches": got_counts,
           "router_counts_per_task": probe.tolist()}
    for name, groups in plans.items():
        loads = el.step_loads(groups, st, EP)
        row[name] = {"lockstep_cpu_ms_min": round(min(got["lockstep"][name]), 1),
                     "lockstep_cpu_ms_median": round(float(np.median(got["lockstep"][name])), 1),
                     "lockstep_cpu_ms": [round(t, 1) for t in got["lockstep"][name]],
                     "wall_ms_min": round(min(got["wall"][name]), 1),
                     "wall_ms": [round(t, 1) for t in got["wall"][name]],
                     "predicted_ms": round(el.predict_ms(planner.cm, groups, st, args.layers), 1),
                     "max_over_mean_rank_load": round(float((loads.max(1) / loads.mean(1)).mean()), 3)}
    row["predicted_blind_believes_ms"] = round(el.predict_ms(planner.cm, blind, st, args.layers,
                                                             load_aware=False), 1)
    for k in ("lockstep_cpu_ms_min", "lockstep_cpu_ms_median", "wall_ms_min"):
        row["speedup_" + k] = round(row["blind"][k] / row["aware"][k], 3)
    row["speedup_predicted"] = round(row["blind"]["predicted_ms"] / row["aware"]["predicted_ms"], 3)
    row["ordering"] = {"pairings": ordering(row, [n for n in plans if not n.startswith("fixed")]),
                       "all_plans": ordering(row, list(plans))}
    print(json.dumps(row), flush=True)


def ordering(row, names) -> dict:
    """The plans by predicted and by measured time, and Kendall's tau between the two."""
    pred = [row[n]["predicted_ms"] for n in names]
    meas = [row[n]["lockstep_cpu_ms_min"] for n in names]
    pairs = [(i, j) for i in range(len(names)) for j in range(i + 1, len(names))]
    agree = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in pairs)
    return {"by_predicted": [names[i] for i in np.argsort(pred)], "by_measured": [names[i] for i in np.argsort(meas)],
            "pairs_in_the_same_order": f"{agree}/{len(pairs)}",
            "kendall_tau": round((2 * agree - len(pairs)) / len(pairs), 3) if pairs else None}


def _probe_counts(args) -> np.ndarray:
    """Per-task router counts of the model the ranks build (EP 1 here: the router is the same)."""
    cfg = ModelConfig(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                      moe=MoEConfig(num_experts=E, router_topk=K, ffn_hidden_size=EXPERT_FFN))
    model = nn.ModuleList([Block(cfg, None, 0, i) for i in range(args.layers)])
    counts = np.zeros((2, E))
    with torch.no_grad():
        for t in (0, 1):
            x = inputs(np.array([64]), np.array([t]), [0], torch.Generator().manual_seed(5 + t))
            for blk in model:
                _, rmap = blk.moe.router(blk.ln2(x).reshape(-1, H), x.shape[0], 1)
                counts[t] += rmap.sum(0).numpy()
                x = blk(x)
    return counts


if __name__ == "__main__":
    main()
