"""Aceso's per-op recompute as priced vs as run, on CPU (fp32, our GPT layer, TP 1).

Prints one JSON line per row:
* memory rows (planner, model, setting, source, mbs, measured_bytes, predicted_bytes, error):
  the bytes one layer keeps for backward under each recompute set the search can emit
  (plus residual / dropout cases), measured with megatron/profiling/saved_memory.py, beside
  PerfModel.activation_terms on tables our profiler writes for the same layer;
* time rows (measured_ms, predicted_ms): one layer's forward + backward with no recompute, a
  search set freeing half the activations, and full recompute, and an `ordering` row saying
  whether measured and predicted time (and memory) order the three settings alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.aceso.memory_check import aceso_rows, aceso_time_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden-size", type=int, default=256, help="layer width")
    ap.add_argument("--seq-length", type=int, default=512, help="tokens per sample")
    ap.add_argument("--micro-batch-sizes", default="1,2", help="comma-separated micro-batch sizes")
    ap.add_argument("--num-attention-heads", type=int, default=8, help="attention heads")
    ap.add_argument("--unfused", action="store_true", help="profile and run without the bias-GeLU / "
                    "bias-dropout-add epilogues")
    ap.add_argument("--skip-time", action="store_true", help="memory rows only")
    args = ap.parse_args()
    shapes = [(args.hidden_size, args.seq_length, int(m)) for m in args.micro_batch_sizes.split(",")]
    for row in aceso_rows(shapes, heads=args.num_attention_heads, fused=not args.unfused):
        print(json.dumps(row), flush=True)
    if not args.skip_time:
        for row in aceso_time_rows(shapes[0], heads=args.num_attention_heads):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
