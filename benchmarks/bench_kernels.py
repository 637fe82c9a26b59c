"""Fused kernels vs eager PyTorch (and torch.compile with --compile): one JSON line per kernel,
shape and thread count, with forward and forward+backward milliseconds (median of --reps runs),
the speed-up, and the bytes autograd saves for backward (the activation memory a kernel costs).

    python benchmarks/bench_kernels.py [--threads 1 2] [--reps 7] [--compile] [--quick]

The last lines time a whole GPT training step (forward + backward) on packed 2048-token rows,
fused vs --no-*-fusion. On a CUDA machine `gpu_benches` adds rows (bf16): packed attention
through dense-masked SDPA, per-sample SDPA, torch's flash varlen kernel (what the model uses on
CUDA), FlexAttention with a block mask, and the project's own CUDA kernel when built; and
bias-dropout-add eager vs fused. GPU rows time with CUDA synchronisation.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron import fused_kernels  # noqa: E402
from megatron.data.packing import pack_samples, packed_attention_mask  # noqa: E402
from megatron.fused_kernels import ops  # noqa: E402


def saved_bytes(fn, inputs):
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and not any(t is x for x in inputs):
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return total[0]


def timed(fn, inputs, backward: bool, reps: int):
    """(wall ms, process CPU ms), medians. On a shared machine the CPU time is the steadier
    number (at 1 thread it is the run time without the waits for other processes)."""
    def once():
        xs = [x.detach().requires_grad_(x.is_floating_point()) if backward else x for x in inputs]
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.set_grad_enabled(backward):
            out = fn(*xs)
            if backward:
                out.backward(torch.ones_like(out))
        return time.perf_counter() - t0, time.process_time() - c0
    once()
    runs = [once() for _ in range(reps)]
    return 1000 * statistics.median(r[0] for r in runs), 1000 * statistics.median(r[1] for r in runs)


def bench(name, shape, impls: dict, inputs, reps, threads, fused_key="fused", base_key="eager"):
    rows = {}
    for label, fn in impls.items():
        try:
            f, fb = timed(fn, inputs, False, reps), timed(fn, inputs, True, reps)
            rows[label] = {"fwd_ms": f[0], "fwd_bwd_ms": fb[0], "fwd_cpu_ms": f[1], "fwd_bwd_cpu_ms": fb[1],
                           "saved_bytes": saved_bytes(fn, [x.detach().requires_grad_(x.is_floating_point())
                                                           for x in inputs])}
        except Exception as e:  # e.g. torch.compile without a working compiler
            rows[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    res = {"kernel": name, "shape": shape, "threads": threads, **{k: v for k, v in rows.items()}}
    if "fwd_ms" in rows.get(fused_key, {}) and "fwd_ms" in rows.get(base_key, {}):
        res["speedup_fwd"] = round(rows[base_key]["fwd_ms"] / rows[fused_key]["fwd_ms"], 2)
        res["speedup_fwd_bwd"] = round(rows[base_key]["fwd_bwd_ms"] / rows[fused_key]["fwd_bwd_ms"], 2)
        res["cpu_speedup_fwd"] = round(rows[base_key]["fwd_cpu_ms"] / rows[fused_key]["fwd_cpu_ms"], 2)
        res["cpu_speedup_fwd_bwd"] = round(rows[base_key]["fwd_bwd_cpu_ms"] / rows[fused_key]["fwd_bwd_cpu_ms"], 2)
    for r in rows.values():
        for k in ("fwd_ms", "fwd_bwd_ms", "fwd_cpu_ms", "fwd_bwd_cpu_ms"):
            if k in r:
                r[k] = round(r[k], 3)
    print(json.dumps(res), flush=True)
    return res


def packed_row(total=2048, n=10, seed=0):
    """One 2048-token row holding ~n samples of random lengths (filled completely)."""
    rng = np.random.RandomState(seed)
    cuts = np.sort(rng.choice(np.arange(1, total), n - 1, replace=False))
    lens = np.diff(np.concatenate([[0], cuts, [total]]))
    return lens


def kernel_benches(args, threads):
    g = torch.Generator().manual_seed(0)
    maybe_compile = (lambda f: torch.compile(f, dynamic=False)) if args.compile else None
    b, h, s = (1, 4, 256) if args.quick else (2, 8, 512)
    x = torch.randn(b, h, s, s, generator=g)
    scale = 0.125
    tri = torch.ones(s, s, dtype=torch.bool).triu(1)
    eager_causal = lambda t: torch.softmax((t * scale).masked_fill(tri, float("-inf")), -1)
    impls = {"eager": eager_causal, "fused": lambda t: ops.scaled_upper_triang_masked_softmax(t, scale, fused=True)}
    if maybe_compile:
        impls["compile"] = maybe_compile(eager_causal)
    bench("causal_softmax", [b, h, s, s], impls, [x], args.reps, threads)

    mask = torch.rand(b, 1, s, s, generator=g) < 0.2
    eager_masked = lambda t: torch.softmax((t * scale).masked_fill(mask, float("-inf")), -1)
    impls = {"eager": eager_masked, "fused": lambda t: ops.scaled_masked_softmax(t, mask, scale, fused=True)}
    if maybe_compile:
        impls["compile"] = maybe_compile(eager_masked)
    bench("masked_softmax", [b, h, s, s], impls, [x], args.reps, threads)

    rows, hid = (512, 1024) if args.quick else (2048, 3072)
    xb, bias = torch.randn(rows, hid, generator=g), torch.randn(hid, generator=g)
    eager_bg = lambda bb, t: F.gelu(t + bb, approximate="tanh")
    impls = {"eager": eager_bg, "fused": lambda bb, t: ops.bias_gelu(bb, t, fused=True)}
    if maybe_compile:
        impls["compile"] = maybe_compile(eager_bg)
    bench("bias_gelu", [rows, hid], impls, [bias, xb], args.reps, threads)

    hid2 = hid // 3
    xd, bd, rd = torch.randn(rows, hid2), torch.randn(hid2), torch.randn(rows, hid2)
    eager_bda = lambda t, bb, r: r + F.dropout(t + bb, 0.1, True)
    impls = {"eager": eager_bda, "fused": lambda t, bb, r: ops.bias_dropout_add(t, bb, r, 0.1, True, fused=True)}
    bench("bias_dropout_add", [rows, hid2], impls, [xd, bd, rd], args.reps, threads)

    # varlen attention: one 2048-token row with ~10 samples, 8 heads x 64
    total, heads, d = (512, 4, 64) if args.quick else (2048, 8, 64)
    lens = packed_row(total, 10)
    seg = torch.from_numpy(np.repeat(np.arange(1, len(lens) + 1), lens))[None]
    cu = ops.cu_seqlens_from_segment_ids(seg)
    dense_mask = packed_attention_mask(seg)
    q, k, v = (torch.randn(total, heads, d, generator=g) for _ in range(3))
    # SDPA gets contiguous [1, h, s, d] inputs (its fast layout; the conversion is not timed)
    q4, k4, v4 = (z.transpose(0, 1)[None].contiguous() for z in (q, k, v))
    to_varlen = lambda z: z[0].transpose(0, 1)
    dense = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    bounds = cu.tolist()

    def per_sample_causal(q, k, v):
        # The samples one by one through SDPA's own causal path, each in its fast contiguous
        # [1, h, l, d] layout (slicing the packed row along tokens gives a strided view).
        outs = [F.scaled_dot_product_attention(*(t[:, :, a:b].contiguous() for t in (q, k, v)), is_causal=True)
                for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs, 2)

    impls = {"dense_masked_sdpa": dense,
             # ops' fallback: strided per-sample slices with an explicit causal mask
             "per_sample_sdpa": lambda q, k, v: ops.varlen_attention(to_varlen(q), to_varlen(k), to_varlen(v), cu,
                                                                     causal=True, fused=False),
             "per_sample_sdpa_causal": per_sample_causal,
             "fused": lambda q, k, v: ops.varlen_attention(to_varlen(q), to_varlen(k), to_varlen(v), cu, causal=True,
                                                           fused=True)}
    r = bench("varlen_attention", {"tokens": total, "samples": len(lens), "heads": heads, "head_dim": d},
              impls, [q4, k4, v4], args.reps, threads, base_key="dense_masked_sdpa")
    per_sample = [r[k] for k in ("per_sample_sdpa", "per_sample_sdpa_causal") if "fwd_bwd_ms" in r.get(k, {})]
    if per_sample and "fwd_bwd_ms" in r.get("fused", {}):
        # against the faster of the two ways of running the samples one by one
        best = min(per_sample, key=lambda x: x["fwd_bwd_ms"])
        best_fwd = min(x["fwd_ms"] for x in per_sample)
        r2 = {"kernel": "varlen_attention_vs_per_sample", "threads": threads,
              "speedup_fwd": round(best_fwd / r["fused"]["fwd_ms"], 2),
              "speedup_fwd_bwd": round(best["fwd_bwd_ms"] / r["fused"]["fwd_bwd_ms"], 2),
              "cpu_speedup_fwd_bwd": round(best["fwd_bwd_cpu_ms"] / r["fused"]["fwd_bwd_cpu_ms"], 2)}
        print(json.dumps(r2), flush=True)
    # unpacked causal attention: SDPA's own causal path vs varlen with one segment (is SDPA faster?)
    one = torch.tensor([0, total])
    causal_sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bench("unpacked_causal_attention", {"tokens": total, "heads": heads, "head_dim": d},
          {"sdpa_causal": causal_sdpa,
           "fused": lambda q, k, v: ops.varlen_attention(to_varlen(q), to_varlen(k), to_varlen(v), one, causal=True,
                                                         fused=True)},
          [q4, k4, v4], args.reps, threads, base_key="sdpa_causal")


def training_step_bench(args, threads):
    from megatron.config.core import ModelConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel import model_parallel_seed
    from megatron.models.gpt import GPTStage
    seq = 512 if args.quick else 2048
    rng = np.random.RandomState(0)
    samples = []
    for _ in range(2):
        samples += [rng.randint(0, 1000, n) for n in packed_row(seq, 10, rng.randint(100))]
    batch = {k: torch.from_numpy(v) for k, v in pack_samples(samples, seq).items()}
    res = {"kernel": "gpt_training_step_packed", "threads": threads,
           "shape": {"rows": int(batch["tokens"].shape[0]), "seq": seq, "layers": 2, "hidden": 256, "heads": 4}}
    for label, fused in (("unfused", False), ("fused", True)):
        cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=seq, vocab_size=1000,
                          make_vocab_size_divisible_by=128, hidden_dropout=0.1, attention_dropout=0.1,
                          masked_softmax_fusion=fused, bias_gelu_fusion=fused, bias_dropout_fusion=fused)
        model_parallel_seed(1, 0, 0)
        model = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=2, pre_process=True, post_process=True,
                         seed=1).train()
        times, cpu = [], []
        for _ in range(max(3, args.reps // 2) + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            (losses,) = model(batch, [])
            (losses * batch["loss_mask"]).sum().backward()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        res[label] = {"step_ms": round(1000 * statistics.median(times[1:]), 1),
                      "step_cpu_ms": round(1000 * statistics.median(cpu[1:]), 1)}
    res["speedup"] = round(res["unfused"]["step_ms"] / res["fused"]["step_ms"], 2)
    res["cpu_speedup"] = round(res["unfused"]["step_cpu_ms"] / res["fused"]["step_cpu_ms"], 2)
    print(json.dumps(res), flush=True)


def gpu_benches(args):
    """CUDA rows; nothing runs without a GPU."""
    dev = torch.device("cuda")

    def timed_cuda(fn, inputs, backward, reps):
        def once():
            xs = [x.detach().requires_grad_(x.is_floating_point()) if backward else x for x in inputs]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward):
                out = fn(*xs)
                if backward:
                    out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        once()
        return 1000 * statistics.median(once() for _ in range(reps))

    def row(name, shape, impls, inputs, base):
        res = {"kernel": name, "device": torch.cuda.get_device_name(), "shape": shape}
        for label, fn in impls.items():
            try:
                res[label] = {"fwd_ms": round(timed_cuda(fn, inputs, False, args.reps), 3),
                              "fwd_bwd_ms": round(timed_cuda(fn, inputs, True, args.reps), 3)}
            except Exception as e:  # a kernel this torch / device lacks
                res[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        for label, r in list(res.items()):
            if isinstance(r, dict) and "fwd_bwd_ms" in r and "fwd_bwd_ms" in res.get(base, {}):
                r["speedup_fwd_bwd_vs_" + base] = round(res[base]["fwd_bwd_ms"] / r["fwd_bwd_ms"], 2)
        print(json.dumps(res), flush=True)

    total, heads, d = 8 * 2048, 16, 128
    lens = np.concatenate([packed_row(2048, 10, seed) for seed in range(8)])
    seg = torch.from_numpy(np.repeat(np.arange(1, len(lens) + 1), lens))[None]
    cu = ops.cu_seqlens_from_segment_ids(seg).to(dev)
    longest = int(lens.max())
    q, k, v = (torch.randn(total, heads, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    rows4 = lambda z: z.view(8, 2048, heads, d).transpose(1, 2)  # [8, h, 2048, d]
    dense_mask = packed_attention_mask(seg.view(8, 2048)).to(dev)  # True = attend, causal within samples
    impls = {
        "dense_masked_sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            rows4(q), rows4(k), rows4(v), attn_mask=dense_mask),
        "torch_varlen": lambda q, k, v: ops.varlen_attention(q, k, v, cu, causal=True, max_seqlen_q=longest),
    }
    if fused_kernels.has_cuda_kernels():
        impls["project_cuda_kernel"] = lambda q, k, v: ops._VarlenAttention.apply(
            q, k, v, cu, cu, 1 / math.sqrt(d), True, 0.0, 0)
    else:  # say so: a missing row would read as "not asked for"
        print(json.dumps({"kernel": "project_cuda_kernel", "skipped": "the extension has no CUDA kernels: "
                          f"{fused_kernels.unavailable_reason() or 'built without nvcc'}"}), flush=True)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = seg.view(8, 2048).to(dev)

        def causal_doc(b, h, qi, ki):
            return (doc[b, qi] == doc[b, ki]) & (qi >= ki)
        block = create_block_mask(causal_doc, 8, None, 2048, 2048, device=dev)
        flex = torch.compile(flex_attention)
        impls["flex_attention"] = lambda q, k, v: flex(rows4(q), rows4(k), rows4(v), block_mask=block)
    except Exception as e:
        print(json.dumps({"kernel": "flex_attention", "error": str(e)[:200]}), flush=True)
    row("packed_attention_cuda", {"rows": 8, "seq": 2048, "samples": int(len(lens)), "heads": heads, "head_dim": d},
        impls, [q, k, v], "dense_masked_sdpa")

    x, b, r = (torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16), torch.randn(2048, device=dev,
               dtype=torch.bfloat16), torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16))
    row("bias_dropout_add_cuda", [8192, 2048],
        {"eager": lambda t, bb, rr: rr + F.dropout(t + bb, 0.1, True),
         "fused": lambda t, bb, rr: ops.bias_dropout_add(t, bb, rr, 0.1, True)}, [x, b, r], "eager")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the eager code")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--no-step", action="store_true", help="skip the whole training-step benchmark")
    ap.add_argument("--gpu-only", action="store_true",
                    help="only the CUDA rows (the project's own CUDA kernel row is left out, saying why, "
                         "when the fused kernels are not built)")
    args = ap.parse_args(argv)
    if args.gpu_only:
        if not torch.cuda.is_available():
            print("bench_kernels: --gpu-only needs a CUDA device; none is visible", file=sys.stderr)
            sys.exit(2)
        if not fused_kernels.load():
            print(json.dumps({"kernel": "project_cuda_kernel",
                              "error": f"fused kernels unavailable: {fused_kernels.unavailable_reason()}"}), flush=True)
        gpu_benches(args)
        return
    if not fused_kernels.load():
        print(json.dumps({"error": f"fused kernels unavailable: {fused_kernels.unavailable_reason()}"}))
        sys.exit(1)
    if torch.cuda.is_available():
        gpu_benches(args)
    for t in args.threads:
        torch.set_num_threads(t)
        kernel_benches(args, t)
        if not args.no_step:
            training_step_bench(args, t)


if __name__ == "__main__":
    main()
