#!/usr/bin/env python
"""Convert checkpoints of this project between tensor / pipeline parallel layouts.

    python tools/checkpoint/convert.py --load runs/ckpt --save runs/ckpt_tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

GPT checkpoints (any TP/PP, learned or RoPE positions, tied or untied output) are re-split to
the target layout with uniform stages. Model weights move bit for bit; optimizer state does not
(it is sharded like the model), so training resumes with a fresh optimizer and LR schedule
position kept, as with Megatron's converter. Exit status: 0 ok, 1 bad checkpoint, 2 bad flags.
Hugging Face import/export is not implemented yet.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.checkpoint.reshard import ReshardError, read_full_model, write_resharded  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint folder (with latest_checkpointed_iteration.txt)")
    p.add_argument("--save", required=True, help="output folder (must not hold a checkpoint already)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracked one)")
    p.add_argument("--target-tensor-parallel-size", type=int, required=True)
    p.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    args = p.parse_args(argv)
    if args.target_tensor_parallel_size < 1 or args.target_pipeline_parallel_size < 1:
        p.error("target sizes must be >= 1")
    if os.path.exists(os.path.join(args.save, "latest_checkpointed_iteration.txt")):
        print(f"convert: error: --save {args.save} already holds a checkpoint; choose an empty folder",
              file=sys.stderr)
        return 2
    try:
        config, full, meta = read_full_model(args.load, args.iteration)
        out = write_resharded(config, full, meta, args.save, args.target_tensor_parallel_size,
                              args.target_pipeline_parallel_size)
    except (ReshardError, OSError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    src = config["parallel"]
    print(f"converted iteration {meta['iteration']}: TP {src['tensor_model_parallel_size']} x PP "
          f"{src['pipeline_model_parallel_size']} -> TP {args.target_tensor_parallel_size} x PP "
          f"{args.target_pipeline_parallel_size}, {len(full)} tensors -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
