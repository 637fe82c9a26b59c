"""Zero-bubble weight pass: bytes a deferred W keeps (weight store) against the whole graph the
executor kept before, the memory model's prediction, and measured B / W times against the
derived rule W = fwd x 6h/(6h+s). One JSON object per row on stdout, progress on stderr.

    PYTHONPATH=. python benchmarks/bench_zb_wpass.py            # CPU, ~1 minute on 2 cores
    PYTHONPATH=. python benchmarks/bench_zb_wpass.py --device cuda --dtype bfloat16 --sizes 1024:2048:2

Rows: a GPT stage of `--layers` layers without (middle) and with (last) the head and the loss,
built by the project's `GPTStage` and run through the executor's own split backward
(`megatron.profiling.weight_pass.measure_split`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.config.core import ModelConfig  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.models.gpt import GPTStage  # noqa: E402
from megatron.planner.cost.wpass_memory import layer_wstore_bytes, post_wstore_bytes  # noqa: E402
from megatron.planner.schedule.zb_search import gemm_share  # noqa: E402
from megatron.profiling.profiler import _seeded  # noqa: E402
from megatron.profiling.weight_pass import measure_split  # noqa: E402


def rows(sizes, layers, device, dtype, iters, vocab, dropout):
    dev = torch.device(device)
    a = torch.finfo(dtype).bits // 8
    for h, s, b in sizes:
        cfg = ModelConfig(model_type="gpt", num_layers=layers, hidden_size=h, num_attention_heads=max(h // 64, 1),
                          ffn_hidden_size=4 * h, vocab_size=vocab, max_position_embeddings=s, seq_length=s,
                          hidden_dropout=dropout, attention_dropout=dropout)
        v = cfg.padded_vocab_size(1)
        for post in (False, True):
            with _seeded(1, 0, dev.type):
                st = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=layers, pre_process=False,
                              post_process=post, seed=1).to(dev, dtype)

                def make():
                    x = torch.randn(s, b, h, device=dev, dtype=dtype)
                    return {"labels": torch.randint(0, vocab, (b, s), device=dev)}, [x]
                m = measure_split(st, make, dev, iters=iters)
            t = s * b
            pred = layers * float(layer_wstore_bytes(t, h, a)) + (float(post_wstore_bytes(t, h, v, a)) if post else 0.0)
            derived_w = m["fwd_ms"] * float(gemm_share(h, s))
            yield dict(role="last" if post else "middle", hidden=h, seq=s, mbs=b, layers=layers, device=dev.type,
                       dtype=str(dtype).replace("torch.", ""), dropout=dropout,
                       graph_bytes=m["graph_bytes"], kept_graph_bytes=m["kept_graph_bytes"],
                       wstore_bytes=m["wstore_bytes"], predicted_wstore_bytes=round(pred),
                       model_error=round(pred / m["wstore_bytes"] - 1, 4),
                       wstore_vs_graph=m["wstore_share"], wstore_vs_kept_graph=m["wstore_vs_kept_graph"],
                       fwd_ms=m["fwd_ms"], b_ms=m["b_ms"], w_ms=m["w_ms"], bwd_ms=m["bwd_ms"],
                       w_derived_ms=round(derived_w, 4), w_measured_over_derived=round(m["w_ms"] / derived_w, 3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64:128:2,128:256:2,256:512:1",
                   help="comma-separated hidden:seq:mbs")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split(":")) for s in a.sizes.split(",")]
    t0 = time.time()
    for i, row in enumerate(rows(sizes, a.layers, a.device, getattr(torch, a.dtype), a.iters, a.vocab, a.dropout)):
        print(json.dumps(row), flush=True)
        print(f"[{i + 1}/{2 * len(sizes)}] {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
