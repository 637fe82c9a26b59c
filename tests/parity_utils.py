"""Helpers for parity tests: train a tiny GPT in any layout, then reassemble full (unsharded,
unpadded) parameters and gradients so layouts can be compared with the single-process run."""
from __future__ import annotations

import re

import torch

from megatron.config import (CheckpointConfig, DataConfig, LoggingConfig, MegatronConfig, ModelConfig,
                             ParallelConfig, TrainingConfig)

VOCAB = 101  # not divisible by any TP degree or padding multiple used here


def tiny_config(world=1, tp=1, pp=1, vpp_layers=None, schedule="1f1b", stage_layers=None, layers=4,
                mbs=2, gbs=8, iters=3, dropout=0.0, recompute=None, fp16=False, bf16=False, save=None,
                load=None, save_interval=None, seq=16, hidden=32, heads=4, lr=1e-3, untie=False, arch=None,
                stage_parallel=None, recompute_layers=None):
    return MegatronConfig(
        model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                          vocab_size=VOCAB, make_vocab_size_divisible_by=8, hidden_dropout=dropout,
                          attention_dropout=dropout, untie_embeddings_and_output_weights=untie, **(arch or {})),
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=vpp_layers, pipeline_schedule=schedule,
                                pipeline_stage_layers=stage_layers, distributed_timeout_minutes=1.0,
                                stage_parallel=stage_parallel),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=iters, lr=lr,
                                lr_warmup_iters=1, seed=1234, recompute_granularity=recompute, fp16=fp16, bf16=bf16,
                                clip_grad=1.0, eval_interval=1000, recompute_layers=recompute_layers),
        data=DataConfig(mock_data=True),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval),
        logging=LoggingConfig(log_interval=1000),
    )


def _global_name(stage, name: str) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.layers.{stage.layer_start + int(m.group(1))}.{m.group(2)}"
    return name


def shards(trainer, what: str = "param") -> dict:
    """{global name: (tensor, partition_dim or None, tp_rank)} for this rank (DP rank 0 only)."""
    out = {}
    if trainer.ps.dp_rank != 0:
        return out
    for stage in trainer.stages.values():
        for name, p in stage.named_parameters():
            if getattr(p, "shared_embedding", False):
                continue  # the last stage's copy of the tied embedding; compared separately
            t = p.detach() if what == "param" else (p.grad.detach() if p.grad is not None else torch.zeros_like(p))
            dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
            out[_global_name(stage, name)] = (t.clone(), dim, trainer.ps.tp_rank)
    return out


def assemble(per_rank: list) -> dict:
    """Merge per-rank shards into full tensors; vocabulary rows beyond VOCAB (padding) are cut."""
    pieces: dict = {}
    for rank_shards in per_rank:
        for name, (t, dim, tp_rank) in rank_shards.items():
            pieces.setdefault(name, {})[tp_rank] = (t, dim)
    full = {}
    for name, by_rank in pieces.items():
        parts = [by_rank[r] for r in sorted(by_rank)]
        dim = parts[0][1]
        t = torch.cat([p[0] for p in parts], dim=dim) if dim is not None else parts[0][0]
        if "word_embeddings" in name or name.startswith("output_layer"):
            t = t[:VOCAB]
        full[name] = t
    return full


def make_trainer(cfg):
    """A GPT Trainer for `cfg` on the already-initialised process group (as pretrain_gpt.py builds it)."""
    from megatron.initialize import initialize_parallel, set_seeds
    from megatron.pretrain import build_gpt_trainer

    from datetime import timedelta
    ps = initialize_parallel(cfg, timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    device = torch.device("cpu")
    set_seeds(cfg.training.seed, ps, device)
    return build_gpt_trainer(cfg, ps, device)


def run_layout(rank, world, cfg_kwargs, steps_with_grads=1):
    """Train with the given layout; return losses, grad norms, step-1 grads and final params."""
    trainer = make_trainer(tiny_config(world=world, **cfg_kwargs))
    ps = trainer.ps
    grads = []
    zero = trainer.optimizer.zero_grad

    def snapshot_then_zero():
        if len(grads) < steps_with_grads:
            grads.append(shards(trainer, "grad"))
        zero()

    trainer.optimizer.zero_grad = snapshot_then_zero
    history = trainer.train()
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "grads": grads, "params": shards(trainer, "param"), "is_last": ps.rank == world - 1}
