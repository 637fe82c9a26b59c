"""Bytes one rank of a context-parallel group keeps for backward, against one process.

Runs CP 1 (one process), CP 2 and CP 4 with both exchanges (all_gather, p2p ring) on gloo
ranks and measures with autograd's saved_tensors_hooks (megatron/profiling/cp_memory.py), per
rank (max over ranks), the attention core and one whole GPT layer. One JSON object per line:

  core_bytes, layer_bytes        saved bytes per rank
  core_peak_bytes, _ratio        forward + backward peak of the core (exchange transients included)
  core_ratio, layer_ratio        / the one-process run (issue 45's targets at S >= 2048:
                                 core <= 0.6 at CP 2, <= 0.35 at CP 4)
  core_model_bytes, _error       cp_cost.attention_core_saved_bytes (predicted / measured - 1)
  layer_model_bytes, _error      the cost model's rule: one process's layer on S/N tokens

    python benchmarks/bench_cp_memory.py [--seq 2048] [--batch 1] [--heads 8] [--head-size 64]
                                         [--dtype float32|bfloat16]

The defaults take ~1 minute of CPU (longer on a loaded machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron.profiling.cp_memory import cp_memory_rows  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", default="1,2,4")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    shape = dict(seq=args.seq, batch=args.batch, heads=args.heads, head_size=args.head_size)
    for row in cp_memory_rows(shape, [int(x) for x in args.sizes.split(",")], dtype=args.dtype):
        print(json.dumps({"benchmark": "cp_memory", **row, "elapsed_s": round(time.perf_counter() - t0, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
