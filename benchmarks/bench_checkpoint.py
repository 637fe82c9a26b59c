"""Save and load time of the two checkpoint formats (--ckpt-format torch / torch_dist), and
how long a save stalls the training loop with and without --async-save.

  nice -n 10 python benchmarks/bench_checkpoint.py [--hidden 512] [--layers 12] [--tp 2] [--pp 2]
                                                   [--dp 1] [--use-distributed-optimizer]
  nice -n 10 python benchmarks/bench_checkpoint.py --async-stall [--steps 4] ...

--async-stall: the stall of a save is the wall time of (save, then --steps training steps, each
followed by the asynchronous save's finalize check, then the wait for the last write) minus the
time of --steps steps without a save; the same for a synchronous save; the best of --reps each,
interleaved. Prints stall_sync_s, stall_async_s and their ratio, plus the loop's wait inside
the save call itself (gather + host copy for --async-save).

Builds a GPT of about 50 M parameters (default) on tp x pp x dp gloo ranks on CPU, trains one step
(so the AdamW state exists), then for each format saves a checkpoint and loads it back into the
same trainer, --reps times, and prints one JSON line: the best save and load wall time of each
(slowest rank, between barriers, checksums and manifest included), the bytes on disk and the
files written. On a shared 2-core machine the numbers are noisy; compare formats within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.launch import run_ranks  # noqa: E402


def _config(args):
    from megatron.config.core import (CheckpointConfig, DataConfig, LoggingConfig, MegatronConfig, ModelConfig,
                                 ParallelConfig, TrainingConfig)
    return MegatronConfig(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(world_size=args.tp * args.pp * args.dp, tensor_model_parallel_size=args.tp,
                                pipeline_model_parallel_size=args.pp, distributed_timeout_minutes=10),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=args.dp, lr=1e-4,
                                train_iters=1 + (3 * args.reps * (args.steps + 1) if args.async_stall else 0),
                                eval_interval=10 ** 6, use_distributed_optimizer=args.use_distributed_optimizer),
        data=DataConfig(mock_data=True), checkpoint=CheckpointConfig(), logging=LoggingConfig(log_interval=10 ** 6))


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank, world, args, root):
    from datetime import timedelta

    from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    cfg = _config(args)
    ps = initialize_model_parallel(args.tp, args.pp, timedelta(minutes=10))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    trainer.train_step()
    if args.async_stall:
        return _stall(trainer, args, root)
    local = sum(p.numel() for s in trainer.stages.values() for p in s.parameters()
                if not getattr(p, "shared_embedding", False))  # the last stage's tied copy: counted once
    n = torch.tensor([local if ps.dp_rank == 0 else 0], dtype=torch.int64)
    dist.all_reduce(n)
    result = {"parameters": int(n)}
    for fmt in ("torch", "torch_dist"):
        d = os.path.join(root, fmt)
        trainer.cfg.checkpoint.ckpt_format = fmt
        saves, loads = [], []
        for _ in range(args.reps):
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            saves.append(_timed(lambda: save_checkpoint(trainer, d)))
            loads.append(_timed(lambda: load_checkpoint(trainer, d)))
        files = [os.path.join(p, f) for p, _, fs in os.walk(d) for f in fs]
        result[fmt] = {"save_s": min(saves), "load_s": min(loads), "bytes": sum(os.path.getsize(f) for f in files),
                       "files": len(files)}
    return result


def _stall(trainer, args, root):
    from megatron.checkpointing import async_save
    from megatron.checkpointing.torch_format import save_checkpoint
    trainer.cfg.checkpoint.async_save = True

    def steps(save=None):
        call = _timed(save) if save else 0.0
        for _ in range(args.steps):
            trainer.train_step()
            async_save.maybe_finalize(trainer)
        async_save.maybe_finalize(trainer, blocking=True)
        return call

    out = {"base": [], "sync": [], "async": [], "sync_call": [], "async_call": []}
    for _ in range(args.reps):
        for kind, save in (("base", None), ("sync", lambda: save_checkpoint(trainer, root)),
                           ("async", lambda: async_save.save_checkpoint_async(trainer, root))):
            calls = []
            out[kind].append(_timed(lambda: calls.append(steps(save))))
            if save:
                out[kind + "_call"].append(calls[0])
    base = min(out["base"])
    res = {k: min(v) for k, v in out.items()}
    res.update(step_s=base / args.steps, stall_sync_s=res["sync"] - base, stall_async_s=res["async"] - base)
    res["async_over_sync_stall"] = res["stall_async_s"] / res["stall_sync_s"]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size")
    ap.add_argument("--use-distributed-optimizer", action="store_true",
                    help="Adam state sharded over DP (torch_dist gathers it per parameter when saving)")
    ap.add_argument("--async-stall", action="store_true", help="measure the training-loop stall of a save with "
                    "and without --async-save (torch format) instead of the two formats' save and load times")
    ap.add_argument("--steps", type=int, default=4, help="with --async-stall: training steps after each save")
    args = ap.parse_args(argv)
    world = args.tp * args.pp * args.dp
    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(_worker, world, args, os.path.join(d, "ckpt"), timeout_s=1800,
                        what="checkpoint benchmark")[0]
    if args.async_stall:
        res.update(config=vars(args))
        print(json.dumps(res), flush=True)
        return
    res.update(config=vars(args), dist_over_torch_save=res["torch_dist"]["save_s"] / res["torch"]["save_s"],
               dist_over_torch_load=res["torch_dist"]["load_s"] / res["torch"]["load_s"])
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
