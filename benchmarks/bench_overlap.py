"""Data-parallel gradient reduction overlapped with the backward passes, or not.

  python benchmarks/bench_overlap.py [--hidden 512] [--layers 4] [--iters 8] [--dp 2] [--pp 1]

Trains the same GPT for --iters steps with the plain all-reduce after the pipeline and with
`--overlap-grad-reduce` (buckets of --bucket elements); with --distributed-optimizer, one
reduce-scatter after the pipeline against bucketed reduce-scatters during the backward passes
plus `--overlap-param-gather`. On gloo over loopback with one CPU
thread per rank, and prints one JSON line: median step time of each and their ratio, plus how
many buckets were launched during the backward passes. On a GPU cluster the same flag hides
the all-reduce behind backward compute on other streams; on CPU both compete for cores, so
the ratio here is a lower bound of what a GPU run gains.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.launch import run_ranks  # noqa: E402


def _config(args, overlap):
    from megatron.config.core import (DataConfig, LoggingConfig, MegatronConfig, ModelConfig, ParallelConfig,
                                 TrainingConfig)
    world = args.dp * args.pp
    return MegatronConfig(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          seq_length=args.seq, vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(world_size=world, pipeline_model_parallel_size=args.pp, distributed_timeout_minutes=5),
        training=TrainingConfig(micro_batch_size=args.mbs, global_batch_size=args.mbs * args.dp * args.microbatches,
                                train_iters=args.iters, lr=1e-4, overlap_grad_reduce=overlap,
                                ddp_bucket_size=args.bucket, eval_interval=10 ** 6,
                                use_distributed_optimizer=args.distributed_optimizer,
                                overlap_param_gather=overlap and args.distributed_optimizer),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=10 ** 6))


def _worker(rank, world, args):
    from datetime import timedelta

    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    result = {}
    for overlap in (False, True):
        cfg = _config(args, overlap)
        ps = initialize_model_parallel(1, args.pp, timedelta(minutes=5))
        set_seeds(cfg.training.seed, ps, torch.device("cpu"))
        trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            trainer.optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
        red = trainer.overlap_reducer
        result["overlap" if overlap else "plain"] = {
            "median_step_ms": statistics.median(times[1:]) * 1e3,
            "buckets": len(red.buckets) if red else None,
            "launched_during_backward": red.overlapped if red else None}
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=2_000_000)
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="both runs use --use-distributed-optimizer; the overlapped one adds --overlap-param-gather "
                         "(bucketed reduce-scatters during backward, asynchronous parameter all-gathers)")
    args = ap.parse_args(argv)
    world = args.dp * args.pp
    res = run_ranks(_worker, world, args, timeout_s=1800, what="overlap benchmark")[0]
    res.update(optimizer="distributed" if args.distributed_optimizer else "plain", config=vars(args),
               overlap_over_plain=res["overlap"]["median_step_ms"] / res["plain"]["median_step_ms"])
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
