"""Optimus-CC on the wire: bytes saved and compression overhead per mechanism, and the
simulated iteration-time gain on slow inter-node links. Prints one JSON object per line.

  python benchmarks/bench_compression.py [--threads N] [--repeats R]

* `cb`: one activation gradient at published-like settings scaled down (sequence 1024,
  micro-batch 2, hidden 1024, rank 16): bytes on the wire, encode + decode time here.
* `dp_powersgd`: one GPT layer's weight gradients (hidden 1024, rank 128): bytes, time of
  the compression arithmetic (the two all-reduces are left out: they are what shrinks).
* `dp_rsvd`: the same layer with the randomized-SVD reducer (--grad-comp-type RandomizedSVD,
  sketch width rank + 4): bytes, compression arithmetic, and the relative error of one step
  on a matrix with a decaying spectrum next to PowerSGD's first (cold) and tenth (warm) step.
* `emb_grad_comp`: the tied-embedding gradient (vocabulary 50304 x hidden 1024) at ranks 4
  and 16 (--emb-grad-comp): bytes per all-reduce, compression arithmetic.
* `tp_grad` / `tp_act`: one tensor-parallel all-reduce of a (1024 x 2 tokens, 1024) tensor at
  rank 4 and 16 (--mp-grad-comp / --mp-acti-comp): bytes (both factor all-reduces), time.
* `fused_embedding`: collectives and bytes of the tied-embedding sync.
* `simulated`: GPT-6.7B on the shipped A100 table (cost_models/gpt_6.7b_a100.json), PP=4 x
  DP=2, 16 micro-batches of 1 x 2048 tokens, 1F1B, pipeline links of 100 and 200 Gb/s:
  iteration time = max over stages of (its last backward's end + its exposed DP all-reduce),
  for no compression, CB (all / epilogue-only, rank 16), and CB + selective DP PowerSGD
  (rank 128 on the first 3 stages, as the published artifact runs it).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
import torch

from megatron.compression import lowrank
from megatron.compression.pipeline import PipelineGradCompressor, wire_numel

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _time(fn, repeats):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def bench_cb(repeats):
    s, b, h, r = 1024, 2, 1024, 16
    g = torch.randn(s, b, h)
    comp = PipelineGradCompressor(lazy_error_propagation=True)
    wire = comp.encode(1, [g], r)
    enc = _time(lambda: comp.encode(1, [g], r), repeats)
    dec = _time(lambda: PipelineGradCompressor.decode([g.shape], r, wire, torch.float32), repeats)
    raw_fp32, raw_bf16 = g.numel() * 4, g.numel() * 2
    sent = wire_numel([g.shape], r) * 4
    return {"bench": "cb", "shape": [s, b, h], "rank": r, "bytes_uncompressed_fp32": raw_fp32,
            "bytes_uncompressed_bf16": raw_bf16, "bytes_sent": sent, "reduction_vs_fp32": raw_fp32 / sent,
            "reduction_vs_bf16": raw_bf16 / sent, "encode_ms": enc, "decode_ms": dec}


def _layer_matrices(h, ffn):
    return [(3 * h, h), (h, h), (ffn, h), (h, ffn)]


def bench_dp(repeats):
    h, r = 1024, 128
    mats = [torch.randn(*shape) for shape in _layer_matrices(h, 4 * h)]
    qs = [lowrank.initial_q(m.shape[1], r, 0, i) for i, m in enumerate(mats)]

    def step():
        for m, q in zip(mats, qs):
            p, q2 = lowrank.compress(m, q)
            lowrank.decompress(p, q2)

    ms = _time(step, max(1, repeats // 4))
    raw = sum(m.numel() for m in mats) * 4
    sent = sum((m.shape[0] + m.shape[1]) * r for m in mats) * 4
    return {"bench": "dp_powersgd", "hidden": h, "rank": r, "bytes_uncompressed": raw, "bytes_sent": sent,
            "reduction": raw / sent, "compress_ms_per_layer": ms}


def _decaying(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, min(rows, cols), generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, min(rows, cols), generator=g))
    s = torch.arange(1, min(rows, cols) + 1, dtype=torch.float32) ** -1.0
    return (u * s) @ v.t()


def bench_rsvd(repeats):
    h, r, over = 1024, 128, 4
    mats = [torch.randn(*shape) for shape in _layer_matrices(h, 4 * h)]

    def step():
        for i, m in enumerate(mats):
            p = lowrank.orthonormalize(m @ lowrank.initial_q(m.shape[1], r + over, 0, ("rsvd", i, 1)))
            lowrank.truncate(p, m.t() @ p, r)

    ms = _time(step, max(1, repeats // 4))
    raw = sum(m.numel() for m in mats) * 4
    sent = sum((m.shape[0] + m.shape[1]) * (r + over) for m in mats) * 4
    m = _decaying(1024, 1024)
    p = lowrank.orthonormalize(m @ lowrank.initial_q(1024, r + over, 0, "e"))
    rsvd_err = float(torch.linalg.norm(lowrank.truncate(p, m.t() @ p, r) - m) / torch.linalg.norm(m))
    q = lowrank.initial_q(1024, r, 0, "e")
    errs = []
    for _ in range(10):
        p, q = lowrank.compress(m, q)
        errs.append(float(torch.linalg.norm(lowrank.decompress(p, q) - m) / torch.linalg.norm(m)))
    best = float(torch.linalg.norm(torch.linalg.svdvals(m)[r:]) / torch.linalg.norm(m))
    return {"bench": "dp_rsvd", "hidden": h, "rank": r, "oversample": over, "bytes_uncompressed": raw,
            "bytes_sent": sent, "reduction": raw / sent, "compress_ms_per_layer": ms,
            "rel_error_1_over_k_spectrum": {"rsvd": rsvd_err, "powersgd_step1": errs[0], "powersgd_step10": errs[-1],
                                            "best_rank_r": best}}


def bench_emb(repeats):
    vocab, h = 50304, 1024
    g = torch.randn(vocab, h)
    out = {"bench": "emb_grad_comp", "shape": [vocab, h], "bytes_uncompressed": g.numel() * 4}
    for r in (4, 16):
        q = lowrank.initial_q(h, r, 0, "emb")
        out[f"rank{r}"] = {"bytes_sent": (vocab + h) * r * 4, "reduction": vocab * h / ((vocab + h) * r),
                           "compress_ms": _time(lambda: lowrank.decompress(*lowrank.compress(g, q)),
                                                max(1, repeats // 4))}
    return out


def bench_tp(repeats):
    tokens, h = 2048, 1024
    x = torch.randn(tokens, h)
    rows = []
    for kind in ("grad", "act"):
        out = {"bench": f"tp_{kind}", "shape": [tokens, h], "bytes_uncompressed": x.numel() * 4}
        for r in (4, 16):
            omega = lowrank.initial_q(h, r, 0, ("tp", kind))

            def step():
                p = lowrank.orthonormalize(x @ omega)
                lowrank.decompress(p, x.t() @ p)

            out[f"rank{r}"] = {"bytes_sent": (tokens + h) * r * 4, "reduction": tokens * h / ((tokens + h) * r),
                               "collectives": 2, "compress_ms": _time(step, repeats)}
        rows.append(out)
    return rows


def bench_fe():
    vocab, h, dp = 50304, 1024, 2
    emb = vocab * h * 4
    return {"bench": "fused_embedding", "embedding_bytes": emb,
            "unfused": {"collectives_on_critical_path": 2, "note": "DP all-reduce (in the gradient buckets) then "
                        "first/last-stage all-reduce"},
            "fused": {"collectives_on_critical_path": 1, "group_size": 2 * dp},
            "bytes_per_rank_unfused": 2 * emb, "bytes_per_rank_fused": emb}


def _dp_allreduce_ms(nbytes, dp, gbps):
    return 2 * (dp - 1) / dp * nbytes * 8 / (gbps * 1e6)


def bench_simulated():
    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    from megatron.planner.schedule.schedules import one_f_one_b
    from megatron.planner.schedule.simulator import PipelineCosts, simulate

    S, dp, K, seq, h, layers = 4, 2, 16, 2048, 4096, 32
    per_stage_params = layers // S * 12 * h * h
    grad_bytes = per_stage_params * 2  # bf16 gradients
    r_dp = 128
    mats = _layer_matrices(h, 4 * h)
    dp_ratio = sum(a * b for a, b in mats) / sum((a + b) * r_dp * 2 for a, b in mats)  # fp32 factors vs bf16
    rows = []
    for gbps in (100.0, 200.0):
        cfg = dict(cost_model_path=str(ROOT / "cost_models" / "gpt_6.7b_a100.json"), model_kind="gpt",
                   hidden_size=h, num_layers=layers, pipeline_parallel=S, data_parallel=dp,
                   memory_limit_mb=36000, bandwidth_gbps=gbps)
        out = {"bench": "simulated", "model": "gpt-6.7b (A100 table)", "pp": S, "dp": dp,
               "microbatches": K, "tokens_per_microbatch": seq, "link_gbps": gbps}
        for name, rank, epi, sc_way in (("none", 0, False, 0), ("cb", 16, False, 0), ("cb_epilogue", 16, True, 0),
                                        ("cb_epilogue+selective_dp", 16, True, 3)):
            planner = DynaPipePlanner(DynaPipeConfig(grad_compress_rank=rank, grad_compress_epilogue_only=epi, **cfg))
            best = None
            for rc in ("none", "selective", "full"):
                sc = planner.stage_costs(rc, np.ones(K), np.full(K, float(seq)))
                if not np.isfinite(sc["fwd"]).all():
                    continue
                costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]),
                                      grad_comm=np.array(sc["grad_comm"]) if "grad_comm" in sc else None,
                                      grad_comm_epilogue_only=epi)
                res = simulate(costs, one_f_one_b(S, list(range(K))))
                if any(p > a for p, a in zip(res.peak_memory, planner.available)):
                    continue
                ends = [max(t for op, t in res.end.items() if op.kind == "B" and op.stage == s) for s in range(S)]
                ar = [_dp_allreduce_ms(grad_bytes / (dp_ratio if s < sc_way else 1.0), dp, gbps) for s in range(S)]
                total = max(e + a for e, a in zip(ends, ar))
                if best is None or total < best[0]:
                    best = (total, rc, res.makespan)
            out[name] = {"iteration_ms": best[0], "pipeline_ms": best[2], "recompute": best[1]}
        base = out["none"]["iteration_ms"]
        for name in ("cb", "cb_epilogue", "cb_epilogue+selective_dp"):
            out[name]["speedup"] = base / out[name]["iteration_ms"]
        rows.append(out)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for row in (bench_cb(args.repeats), bench_dp(args.repeats), bench_rsvd(args.repeats), bench_emb(args.repeats),
                *bench_tp(args.repeats), bench_fe(), *bench_simulated()):
        row["threads"] = args.threads
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
