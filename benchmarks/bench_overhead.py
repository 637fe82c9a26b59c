"""Framework overhead: one training step of our GPT (TP=1, PP=1, through planner + executor)
against a plain PyTorch implementation of the identical model, in the same process.

Both sides do the same work per step: the same micro-batches (collated from the same mock
samples), forward + backward per micro-batch with token-normalised loss, global-norm clipping
and an AdamW step. Steps alternate between the two so drift hits both equally.

    python benchmarks/bench_overhead.py [--hidden 256 --layers 4 --seq 256 ...]

Prints one JSON object; `overhead` = ours / plain - 1 (target <= 0.10 on CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.plain_gpt import PlainGPT
from megatron.training.batching import gpt_microbatch
from megatron.config.core import (DataConfig, LoggingConfig, MegatronConfig, ModelConfig, ParallelConfig,
                             TrainingConfig)
from megatron.core.parallel_state import ParallelState
from megatron.training.initialize import set_seeds
from megatron.training.pretrain import build_gpt_trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()

    cfg = MegatronConfig(
        model=ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                          vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(),
        training=TrainingConfig(micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
                                train_iters=a.steps + a.warmup, lr=1e-4),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=10 ** 9))
    ps, dev = ParallelState(), torch.device("cpu")
    set_seeds(cfg.training.seed, ps, dev)
    ours = build_gpt_trainer(cfg, ps, dev)

    plain = PlainGPT(a.vocab, a.hidden, a.heads, 4 * a.hidden, a.layers, a.seq)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01)
    n_micro = a.global_batch_size // a.micro_batch_size

    def plain_step(step):
        base = step * a.global_batch_size
        mbs = [gpt_microbatch([ours.batch_source.dataset[base + k * a.micro_batch_size + j] for j in range(a.micro_batch_size)])
               for k in range(n_micro)]
        denom = sum(float(mb["loss_mask"].sum()) for mb in mbs)
        for mb in mbs:
            plain(mb["tokens"], mb["labels"], mb["loss_mask"], denom).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_ours, t_plain = [], []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        ours.train_step()
        t1 = time.perf_counter()
        plain_step(step)
        t2 = time.perf_counter()
        if step >= a.warmup:
            t_ours.append(t1 - t0)
            t_plain.append(t2 - t1)
    mo, mp = statistics.median(t_ours), statistics.median(t_plain)
    n_params_ours = sum(p.numel() for m in ours.modules for p in m.parameters())
    n_params_plain = sum(p.numel() for p in plain.parameters())
    print(json.dumps({
        "benchmark": "train_step_overhead", "device": "cpu", "threads": torch.get_num_threads(),
        "hidden": a.hidden, "layers": a.layers, "seq": a.seq, "vocab": a.vocab,
        "global_batch_size": a.global_batch_size, "micro_batch_size": a.micro_batch_size,
        "params_ours": n_params_ours, "params_plain": n_params_plain,
        "ours_ms_median": round(mo * 1e3, 2), "plain_ms_median": round(mp * 1e3, 2),
        "ratio": round(mo / mp, 4), "overhead": round(mo / mp - 1, 4), "target_overhead": 0.10,
        "steps": a.steps,
    }))


if __name__ == "__main__":
    main()
