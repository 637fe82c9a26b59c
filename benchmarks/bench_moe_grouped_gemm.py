"""--moe-grouped-gemm vs the per-expert loop: the local experts' forward and forward+backward in
milliseconds (median of --reps), one JSON line per (experts, tokens, hidden, ffn, dtype, device).

    python benchmarks/bench_moe_grouped_gemm.py [--reps 7] [--threads 1] [--quick]

Tokens are routed unevenly (a skewed multinomial over the experts, some experts empty), as
after a real router. It times `megatron.models.moe.experts.LocalExperts` itself, so the rows are
what a MoE layer pays; on CUDA the rows use bf16 and synchronise before each clock read.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.config.core import ModelConfig  # noqa: E402
from megatron.config.moe import MoEConfig  # noqa: E402
from megatron.models.moe.experts import LocalExperts  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, reps: int, dev) -> float:
    fn()
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def counts_for(tokens: int, experts: int, gen) -> list:
    weights = torch.rand(experts, generator=gen) ** 3  # skewed
    weights[0] = 0.0  # an empty expert
    idx = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.bincount(idx, minlength=experts).tolist()


def bench(experts, tokens, hidden, ffn, dtype, dev, reps) -> dict:
    gen = torch.Generator().manual_seed(0)
    row = {"experts": experts, "tokens": tokens, "hidden": hidden, "ffn": ffn, "dtype": str(dtype).split(".")[-1],
           "device": dev.type}
    cfg = ModelConfig(hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=ffn, swiglu=True,
                      add_bias_linear=False)
    counts = counts_for(tokens, experts, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dev, dtype)
    for grouped in (False, True):
        moe = MoEConfig(num_experts=experts, grouped_gemm=grouped)
        ex = LocalExperts(cfg, moe, first_expert=0, num_local=experts, seed=1, key="bench", out_std=0.02).to(dev, dtype)
        xg = x.clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                ex(x, counts)

        def fwd_bwd():
            ex(xg, counts).float().square().mean().backward()

        name = "grouped" if grouped else "loop"
        row[f"{name}_fwd_ms"] = round(time_ms(fwd, reps, dev), 3)
        row[f"{name}_fwd_bwd_ms"] = round(time_ms(fwd_bwd, reps, dev), 3)
    row["speedup_fwd_bwd"] = round(row["loop_fwd_bwd_ms"] / row["grouped_fwd_bwd_ms"], 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one small shape (CI smoke)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA where visible")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(8, 512, 128, 256)] if a.quick else [(8, 2048, 256, 512), (32, 2048, 256, 128), (64, 4096, 256, 128)]
    if dev.type == "cuda" and not a.quick:
        shapes += [(8, 16384, 4096, 14336 // 4), (64, 16384, 2048, 1408)]
    for e, t, h, f in shapes:
        print(json.dumps(bench(e, t, h, f, dtype, dev, a.reps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
