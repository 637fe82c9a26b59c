"""DynaPipe planner benchmark on the shipped A100 cost models. Prints one JSON object per line
per (model, max length).

Setup (DynaPipe's 8-GPU node): GPT-6.7B, 32 layers, PP=4 (8 layers per stage), DP=2, TP=1;
T5-11B, 24+24 layers, PP=4 (two encoder stages of 12 layers, two decoder stages of 12), TP=2,
DP=1 (see `config`). Device memory limit 36000 MB, model states (16-bit weights + grads, Adam state ZeRO-1
sharded over DP) subtracted per stage. 65,536 tokens per global batch.

Lengths: deterministic (seeded) mixtures, see `MIXTURES` (--mixtures): the original
heavy-tailed multi-task mix (`TASKS`: each task draws input and target lengths from
log-normals), a FLAN-like mix (mostly short prompts with 1-5-token targets, QA, some
generation, a few long documents truncated at the max length), one heavy-tailed log-normal,
and an adversarial bimodal mix. GPT trains on input+target concatenated, T5 on (input,
target); both truncated to the max length. Samples are added to the
global batch until the token budget would be exceeded.

Measured per configuration, over `--iters` global batches:
* planning_ms_median / _p90: `DynaPipePlanner.plan` (ordering, partition under each recompute
  level, DP-group split, schedule search for every DP group), single thread, caches warm
  (the first `--warmup` batches fill the per-length cost cache and are not counted; the
  first of them is reported as cold_first_iteration_ms); planning_cpu_ms_*: the same in
  process CPU time (less sensitive to other load on a shared machine);
  lowering_ms_median: lowering + validating the instruction streams of all ranks (separate).
* padding_efficiency: real tokens / computed tokens (micro-batch size x padded length; T5:
  size x (padded input max + padded target max), the target with its 2 bos/eos tokens).
  padding_efficiency_bound: the same with every sample alone (rounding to `pad_multiple`
  and bos/eos only), the most any partition can reach.
* speedup_vs_<baseline>: simulated iteration time of each baseline (`megatron.planner.dynapipe.baselines`;
  best micro-batch size and recompute that fit, 1F1B) over DynaPipe's, same batches:
  packing (the DynaPipe paper's: next-fit max-length rows, attention over the whole row),
  packing_varlen (the same rows with per-document attention: Megatron-Core THD,
  `--pack-dataset`), packing_balanced (WLB-LLM: cost-balanced micro-batches, per-document
  attention, long outliers deferred at most one iteration over the measured batches), fixed
  (unpacked samples in data order, each micro-batch padded to its longest sample).
  speedup_vs_best_baseline: against the fastest of them. Ratios of summed iteration times =
  throughput ratios (the same real tokens are trained). Per-document attention is priced by
  `megatron.planner.cost.attention_cost` (s^2 share fitted from the table's dense rows; the A100
  tables predate flash attention, so a varlen row's memory is taken as linear in tokens while
  dense rows keep the table's s^2 memory).
* DynaPipe here also searches micro-batches of packed rows (`--no-packed-rows`: the paper's
  planner alone); packed_plan_fraction: how often it chose them.
* `--zero-bubble` (the split backward, megatron/planner/schedule/zb_search.py) adds a `zb` object per
  row: DynaPipe+ZB (schedule "zb" in the search, the planner keeping the faster of its plans
  with and without the split) on the same batches; speedup_vs_dynapipe median / min / max
  over the iterations (per-iteration ratio of DynaPipe's simulated time to DynaPipe+ZB's),
  never_slower (no iteration slower), split_fraction (DP groups run split), and summed-time
  speed-ups against ZB-H1 and ZB-V (megatron/planner/schedule/zb_baselines.py) as a torchtitan /
  Megatron-Core user runs them, over packed rows with per-document attention (`_packed`: the
  fair baselines), and over unpacked samples padded to the longest (`_fixed`), and against the
  packing/fixed baselines above. The A100 tables time whole backward passes:
  the W share is derived (w_split says how).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # single core, as the target says

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner  # noqa: E402
from megatron.planner.dynapipe.baselines import NAMES, BalancedStream, baselines  # noqa: E402  (shared with megatron.experiments)

# (weight, input median, input sigma, target median, target sigma)
TASKS = [
    (0.35, 60, 0.6, 6, 0.7),      # short QA / classification prompts
    (0.25, 180, 0.5, 30, 0.8),    # NLI, extraction
    (0.20, 500, 0.7, 90, 0.6),    # summarisation
    (0.12, 1400, 0.8, 200, 0.8),  # long-context reading / dialogue
    (0.08, 4000, 0.8, 400, 0.9),  # long documents: the heavy tail
]


def _lognormal(median, sigma):
    return lambda rng, L: max(1, int(rng.lognormal(np.log(median), sigma)))


def _uniform(lo, hi):
    return lambda rng, L: int(rng.integers(lo, hi + 1))


def _max_len(frac=1.0):
    return lambda rng, L: max(1, int(L * frac))


# Mixtures: name -> [(weight, input length sampler, target length sampler)]; samplers get
# (rng, max_len). All lengths are truncated at the max length afterwards.
MIXTURES = {
    # the bench's original multi-task mix (TASKS)
    "multitask": [(w, _lognormal(im, isg), _lognormal(tm, tsg)) for w, im, isg, tm, tsg in TASKS],
    # FLAN-like: mostly short templated prompts with 1-5-token answers (classification,
    # multiple choice), question answering with short answers, some generation, and a few
    # long documents truncated at the max length.
    "flan": [
        (0.50, _lognormal(90, 0.6), _uniform(1, 5)),
        (0.25, _lognormal(350, 0.5), _lognormal(8, 0.7)),
        (0.15, _lognormal(700, 0.6), _lognormal(120, 0.6)),
        (0.06, _lognormal(1800, 0.5), _lognormal(60, 0.8)),
        (0.04, _max_len(), _lognormal(150, 0.5)),
    ],
    # one heavy-tailed log-normal for inputs and targets (sigma 1.3: a long right tail)
    "heavy": [(1.0, _lognormal(150, 1.3), _lognormal(20, 1.2))],
    # adversarial bimodal: many tiny samples and a fifth at the max length
    "bimodal": [(0.8, _lognormal(24, 0.3), _uniform(1, 3)), (0.2, _max_len(), _uniform(1, 3))],
}


def make_batches(kind, max_len, tokens, n, seed, mixture="multitask"):
    rng = np.random.default_rng(seed)
    tasks = MIXTURES[mixture]
    w = np.array([t[0] for t in tasks])
    batches = []
    for _ in range(n):
        batch, used = [], 0
        while True:
            _, draw_in, draw_tgt = tasks[rng.choice(len(tasks), p=w / w.sum())]
            inp, tgt = max(4, draw_in(rng, max_len)), max(1, draw_tgt(rng, max_len))
            if kind == "gpt":
                sample = min(max_len, inp + tgt)
                cost = sample
            else:
                sample = (min(max_len, inp), min(max_len, tgt))
                cost = sum(sample)
            if used + cost > tokens:
                break
            batch.append(sample)
            used += cost
        batches.append(batch)
    return batches


def config(kind, cm_dir):
    if kind == "gpt":
        return DynaPipeConfig(cost_model_path=str(cm_dir / "gpt_6.7b_a100.json"), model_kind="gpt",
                              hidden_size=4096, num_layers=32, pipeline_parallel=4, data_parallel=2,
                              memory_limit_mb=36000)
    # TP=2, DP=1. DP=2 (TP=1) fits only at max length 512: with TP=1 the model states leave
    # 11.4 GB (encoder stages) / 3.35 GB (decoder stages) for activations, and with full
    # recompute a (2048, 2048) sample peaks at 4.0 GB on a decoder stage and a 4096-token
    # input at 16.2 GB on an encoder stage, so some 2048 and all 4096 batches are infeasible.
    return DynaPipeConfig(cost_model_path=str(cm_dir / "t5_11b_a100.json"), model_kind="t5", hidden_size=1024,
                          encoder_layers=24, decoder_layers=24, pipeline_parallel=4, data_parallel=1,
                          tensor_parallel=2, memory_limit_mb=36000)


# --moe: GPT-6.7B with every other layer a mixture of 8 experts of half the dense FFN width,
# top-2 (each token's expert FLOPs equal the dense MLP's), EP 2 over the two DP groups, alltoall
# at 100 GB/s per GPU (NVSwitch); priced from the dense A100 table (megatron/planner/cost/moe_cost.py).
MOE = dict(num_experts=8, topk=2, expert_ffn=8192, ep=2, dispatcher="alltoall", layer_fraction=0.5, a2a_gbps=100.0)


def run(kind, max_len, args, mixture="multitask"):
    cfg = config(kind, Path(args.cost_models))
    if args.moe:
        from megatron.planner.cost.moe_cost import MoEPricing
        cfg.moe = MoEPricing(**MOE)
    cfg.packed_rows, cfg.packed_max_len = not args.no_packed_rows, max_len
    planner = DynaPipePlanner(cfg)
    seed = 1000 + max_len + (0 if mixture == "multitask" else 7919 * (1 + sorted(MIXTURES).index(mixture)))
    batches = make_batches(kind, max_len, args.tokens, args.warmup + args.iters, seed=seed, mixture=mixture)
    cfg.emit_plans = False
    cold_ms = None
    for k, b in enumerate(batches[:args.warmup]):
        t0 = time.perf_counter()
        planner.plan(b)
        if k == 0:
            cold_ms = (time.perf_counter() - t0) * 1e3  # empty cost caches
    times, cpu, effs, dyn, lower_ms, bounds = [], [], [], [], [], []
    base_t = {name: [] for name in NAMES}
    picks = {"recompute": {}, "schedule": {}, **{"baseline_" + name: {} for name in NAMES}}
    n_mb, n_packed = [], 0
    stream = BalancedStream(kind, max_len)
    nb_total = min(args.baseline_iters, args.iters)
    for i, b in enumerate(batches[args.warmup:]):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = planner.plan(b, i)
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        effs.append(plan.padding_efficiency)
        raw = np.asarray(b, dtype=np.int64)
        if kind == "gpt":
            bounds.append(raw.sum() / planner._pad(raw).sum())
        else:
            bounds.append(raw.sum() / (planner._pad(raw[:, 0]).sum()
                                       + planner._pad(raw[:, 1], cfg.decoder_extra_tokens).sum()))
        dyn.append(plan.makespan_ms)
        n_packed += plan.groups[0].rows is not None
        n_mb.append(sum(len(g.microbatches) for g in plan.groups))
        picks["recompute"][plan.recompute] = picks["recompute"].get(plan.recompute, 0) + 1
        for g in plan.groups:
            picks["schedule"][g.schedule] = picks["schedule"].get(g.schedule, 0) + 1
        if i < args.lower_iters:
            cfg.emit_plans = True
            lower_ms.append(planner.plan(b, i).lowering_ms)
            cfg.emit_plans = False
        if i < nb_total:
            base = baselines(planner, kind, b, max_len, names=[n for n in NAMES if n != "packing_balanced"])
            # WLB-LLM defers long documents across iterations: its batch is the stream's.
            deferred = stream.next(b, last=i == nb_total - 1)
            base.update(baselines(planner, kind, deferred, max_len, names=("packing_balanced",)))
            for name in NAMES:
                base_t[name].append(base[name][0])
                key = f"b{base[name][1]}/{base[name][2]}"
                picks["baseline_" + name][key] = picks["baseline_" + name].get(key, 0) + 1
    nb = len(base_t["fixed"])
    ratio = lambda base: (sum(base) / sum(dyn[:nb])) if nb and np.isfinite(sum(base)) else None  # noqa: E731
    speedups = {name: ratio(base_t[name]) for name in NAMES}
    finite = [v for v in speedups.values() if v is not None]
    return {
        "model": ("gpt_6.7b" if kind == "gpt" else "t5_11b") + ("_moe" if args.moe else ""), "mixture": mixture,
        "max_len": max_len, **({"moe": MOE} if args.moe else {}),
        "tokens_per_batch": args.tokens,
        "pp": cfg.pipeline_parallel, "dp": cfg.data_parallel, "tp": cfg.tensor_parallel,
        "layers_per_stage": planner.layout[0][0][1], "iterations": len(times),
        "samples_per_batch_mean": round(float(np.mean([len(b) for b in batches[args.warmup:]])), 1),
        "microbatches_mean": round(float(np.mean(n_mb)), 1),
        "planning_ms_median": round(statistics.median(times), 2),
        "planning_ms_p90": round(float(np.percentile(times, 90)), 2),
        "planning_cpu_ms_median": round(statistics.median(cpu), 2),
        "planning_cpu_ms_p90": round(float(np.percentile(cpu, 90)), 2),
        "cold_first_iteration_ms": round(cold_ms, 1) if cold_ms is not None else None,
        "lowering_ms_median": round(statistics.median(lower_ms), 2) if lower_ms else None,
        "padding_efficiency": round(float(np.mean(effs)), 4),
        "padding_efficiency_min": round(float(np.min(effs)), 4),
        "padding_efficiency_bound": round(float(np.mean(bounds)), 4),
        "iteration_ms_mean": round(float(np.mean(dyn)), 1),
        **{f"speedup_vs_{name}": None if v is None else round(v, 3) for name, v in speedups.items()},
        "speedup_vs_best_baseline": round(min(finite), 3) if finite else None,
        "packed_plan_fraction": round(n_packed / len(dyn), 3),
        "choices": picks,
        "note": None if all(np.isfinite(sum(v)) for v in base_t.values()) else
        "a baseline is infeasible on some batches: no fixed micro-batch size / recompute fits the memory "
        "limit with 1F1B on this layout (speed-up reported as null)",
        **({"zb": zero_bubble_row(cfg, kind, max_len, batches[args.warmup:], dyn, base_t, nb, args)}
           if args.zero_bubble else {}),
    }


def zero_bubble_row(cfg, kind, max_len, batches, dyn, base_t, nb, args) -> dict:
    """DynaPipe+ZB on the same batches against DynaPipe (`dyn`), ZB on fixed micro-batches and
    the baselines (`base_t`, the first `nb` batches); see the module docstring."""
    import dataclasses
    from megatron.planner.schedule.zb_baselines import zb_fixed_time, zb_packed_time
    from megatron.planner.schedule.zb_search import w_share_text
    zcfg = dataclasses.replace(cfg, schedules=tuple(cfg.schedules) + ("zb",), emit_plans=False)
    planner = DynaPipePlanner(zcfg)
    for b in batches[:args.warmup]:
        planner.plan(b)
    zb, split, groups, times = [], 0, 0, []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        plan = planner.plan(b, i)
        times.append((time.perf_counter() - t0) * 1e3)
        zb.append(plan.makespan_ms)
        split += sum(g.schedule == "zb" for g in plan.groups)
        groups += len(plan.groups)
    ratios = [d / z for d, z in zip(dyn, zb)]
    fixed = {name: [zb_fixed_time(planner, kind, b, max_len, name)[0] for b in batches[:nb]]
             for name in ("zb-h1", "zb-v")}
    packed_rows = {name: [zb_packed_time(planner, kind, b, max_len, name)[0] for b in batches[:nb]]
                   for name in ("zb-h1", "zb-v")}
    ratio = lambda base: round(sum(base) / sum(zb[:nb]), 3) if nb and np.isfinite(sum(base)) else None  # noqa: E731
    return {
        "speedup_vs_dynapipe_median": round(statistics.median(ratios), 4),
        "speedup_vs_dynapipe_min": round(min(ratios), 4), "speedup_vs_dynapipe_max": round(max(ratios), 4),
        "never_slower": all(z <= d * (1 + 1e-9) for z, d in zip(zb, dyn)),
        "split_fraction": round(split / groups, 3), "iteration_ms_mean": round(float(np.mean(zb)), 1),
        "planning_ms_median": round(statistics.median(times), 2),
        **{f"speedup_vs_{name}_packed": ratio(v) for name, v in packed_rows.items()},
        **{f"speedup_vs_{name}_fixed": ratio(v) for name, v in fixed.items()},
        **{f"speedup_vs_{name}": ratio(v) for name, v in base_t.items()},
        "w_split": w_share_text(cfg.hidden_size),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Defaults: one mixture and few iterations, about 5 minutes with --zero-bubble on 2 cores;
    # --full: every mixture and the original iteration counts (the docs' tables, about an hour).
    ap.add_argument("--full", action="store_true", help="every mixture, 20 iterations (8 with baselines)")
    ap.add_argument("--models", default="gpt,t5")
    ap.add_argument("--gpt-max-lens", default="512,2048,8192")
    ap.add_argument("--t5-max-lens", default="512,2048,4096", help="the T5 table stops at 4096")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=None, help="default 6 (--full: 20)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2 (--full: 3)")
    ap.add_argument("--baseline-iters", type=int, default=None, help="default 3 (--full: 8)")
    ap.add_argument("--lower-iters", type=int, default=None, help="default 1 (--full: 3)")
    ap.add_argument("--cost-models", default=str(ROOT / "cost_models"))
    ap.add_argument("--mixtures", default=None,
                    help=f"length mixtures, from {sorted(MIXTURES)} (default multitask; --full: all four)")
    ap.add_argument("--zero-bubble", action="store_true",
                    help="also plan with the split backward (DynaPipe+ZB) and compare it with DynaPipe and ZB-H1/ZB-V")
    ap.add_argument("--no-packed-rows", action="store_true",
                    help="DynaPipe without micro-batches of packed rows (the paper's planner alone)")
    ap.add_argument("--moe", action="store_true",
                    help="GPT only: price every other layer as a mixture of experts (`MOE`, docs/moe.md)")
    args = ap.parse_args(argv)
    if args.moe and args.models != "gpt":
        if "gpt" not in args.models.split(","):
            ap.error("--moe prices GPT tables only: use --models gpt")
        args.models = "gpt"
    for key, quick, full in (("iters", 6, 20), ("warmup", 2, 3), ("baseline_iters", 3, 8), ("lower_iters", 1, 3),
                             ("mixtures", "multitask", "multitask,flan,heavy,bimodal")):
        if getattr(args, key) is None:
            setattr(args, key, full if args.full else quick)
    best, zb_rows = [], []
    todo = [(mixture, kind, int(L)) for mixture in args.mixtures.split(",") for kind in args.models.split(",")
            for L in getattr(args, f"{kind}_max_lens").split(",")]
    start = time.perf_counter()
    for mixture in args.mixtures.split(","):
        if mixture not in MIXTURES:
            ap.error(f"--mixtures: unknown mixture {mixture!r}; choose from {sorted(MIXTURES)}")
    for k, (mixture, kind, L) in enumerate(todo):
        print(f"bench_planner: row {k + 1}/{len(todo)}: {kind} {mixture} max length {L} "
              f"({time.perf_counter() - start:.0f} s so far)", file=sys.stderr, flush=True)
        row = run(kind, L, args, mixture)
        print(json.dumps(row), flush=True)
        if row["speedup_vs_best_baseline"] is not None:
            best.append(row["speedup_vs_best_baseline"])
        if row.get("zb"):
            zb_rows.append(row["zb"])
    if best:
        print(json.dumps({"summary": "speedup_vs_best_baseline over rows", "rows": len(best),
                          "median": round(statistics.median(best), 3), "min": min(best), "max": max(best)}))
    if zb_rows:
        med = [z["speedup_vs_dynapipe_median"] for z in zb_rows]
        print(json.dumps({"summary": "DynaPipe+ZB speedup_vs_dynapipe (per-row medians)", "rows": len(zb_rows),
                          "median": round(statistics.median(med), 4), "min": min(z["speedup_vs_dynapipe_min"]
                                                                                  for z in zb_rows),
                          "max": max(z["speedup_vs_dynapipe_max"] for z in zb_rows),
                          "never_slower_all_rows": all(z["never_slower"] for z in zb_rows)}))


if __name__ == "__main__":
    main()
