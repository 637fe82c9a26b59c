"""Helpers for parity tests: train a tiny GPT in any layout, then reassemble full (unsharded,
unpadded) parameters and gradients so layouts can be compared with the single-process run."""
from __future__ import annotations

import math
import re

import pytest
import torch

from megatron.config.core import (CheckpointConfig, DataConfig, LoggingConfig, MegatronConfig, ModelConfig,
                             ParallelConfig, TrainingConfig)

VOCAB = 101  # not divisible by any TP degree or padding multiple used here


def tiny_config(world=1, tp=1, pp=1, vpp_layers=None, schedule="1f1b", stage_layers=None, layers=4,
                mbs=2, gbs=8, iters=3, dropout=0.0, recompute=None, fp16=False, bf16=False, save=None,
                load=None, save_interval=None, seq=16, hidden=32, heads=4, lr=1e-3, untie=False, arch=None,
                stage_parallel=None, recompute_layers=None, cp=1, cp_comm="all_gather", cp_keyed=False):
    return MegatronConfig(
        model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                          vocab_size=VOCAB, make_vocab_size_divisible_by=8, hidden_dropout=dropout,
                          attention_dropout=dropout, untie_embeddings_and_output_weights=untie, **(arch or {})),
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=vpp_layers, pipeline_schedule=schedule,
                                pipeline_stage_layers=stage_layers, distributed_timeout_minutes=1.0,
                                stage_parallel=stage_parallel, context_parallel_size=cp, cp_comm_type=cp_comm,
                                cp_keyed_dropout=cp_keyed),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=iters, lr=lr,
                                lr_warmup_iters=1, seed=1234, recompute_granularity=recompute, fp16=fp16, bf16=bf16,
                                clip_grad=1.0, eval_interval=1000, recompute_layers=recompute_layers),
        data=DataConfig(mock_data=True),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval),
        logging=LoggingConfig(log_interval=1000),
    )


def _global_name(stage, name: str) -> str:
    m = re.match(r"(encoder|decoder)\.layers\.(\d+)\.(.*)", name)
    if m:  # GPT stages start at layer_start, T5 stages at encoder_layers[0] / decoder_layers[0]
        start = ((stage.encoder_layers if m.group(1) == "encoder" else stage.decoder_layers)[0]
                 if hasattr(stage, "decoder_layers") else stage.layer_start)
        return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}"
    return name


def shards(trainer, what: str = "param") -> dict:
    """{global name: (tensor, partition_dim or None, tp_rank)} for this rank (DP rank 0 only)."""
    out = {}
    if trainer.ps.dp_rank != 0 or trainer.ps.cp_rank != 0:
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
    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer

    from datetime import timedelta
    ps = initialize_parallel(cfg, timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    device = torch.device("cpu")
    set_seeds(cfg.training.seed, ps, device)
    return build_gpt_trainer(cfg, ps, device)


def run_layout(rank, world, cfg_kwargs, steps_with_grads=None):
    """Train with the given layout; return losses, grad norms, every step's grads (the first
    `steps_with_grads` if given: they bound the parameters' tolerance) and final params."""
    return train_and_record(make_trainer(tiny_config(world=world, **cfg_kwargs)), world,
                            steps_with_grads=steps_with_grads)


def train_and_record(trainer, world: int, get=None, steps_with_grads=None, each_step=None) -> dict:
    """Train `trainer` and return what `assert_parity` compares: losses, grad norms, every step's
    gradients (the first `steps_with_grads` if given; they bound the parameters' tolerance), the
    final parameters (after any in-flight parameter gather), whether this rank reports the loss,
    and each step's planner line, sample count and communication bytes. `get(what)` reads this
    rank's "grad" or "param" shards (default `shards`); `each_step()` runs after each step's
    gradients are read, before they are zeroed (e.g. a reference codec ending its iteration)."""
    get = get or (lambda what: shards(trainer, what))
    grads, zero = [], trainer.optimizer.zero_grad

    def snapshot_then_zero():
        if steps_with_grads is None or len(grads) < steps_with_grads:
            grads.append(get("grad"))
        if each_step is not None:
            each_step()
        zero()

    trainer.optimizer.zero_grad = snapshot_then_zero
    history = trainer.train()
    if hasattr(trainer.optimizer, "finish_param_gather"):
        trainer.optimizer.finish_param_gather()
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "grads": grads, "params": get("param"), "is_last": trainer.ps.rank == world - 1,
            "info": [h.get("planner") for h in history], "samples": [h.get("num_samples") for h in history],
            "comm_bytes": [h.get("comm_bytes") for h in history], **tolerance_inputs(trainer.cfg)}


def tolerance_inputs(cfg) -> dict:
    """What the derived tolerances need to know of a run: tokens reduced per step, lr, Adam eps."""
    m = cfg.model
    seq = m.encoder_seq_length + m.decoder_seq_length if m.model_type == "t5" else m.seq_length
    return {"tokens": cfg.training.global_batch_size * seq, "lr": cfg.training.lr, "eps": cfg.training.adam_eps}


# -- tolerances ------------------------------------------------------------------------------
# Parity claims are exact mathematics computed in floating point, so every tolerance below is
# derived from the dtype's unit roundoff u, the number of terms a reduction sums, the magnitude
# compared and the number of optimizer steps. Nothing is tuned to pass on one CPU.
#
# 1. Gradients (one backward). Two layouts sum the same products in other orders (TP splits,
#    micro-batches, fused vs unfused kernels, AVX-512 vs AVX2 vector widths, thread counts).
#    With n tokens reduced, the rounding error of an element is about u * sqrt(n) * (sum of
#    |terms|), and the largest element of the tensor bounds that sum's scale. So, per tensor,
#        atol_g = C_G * u * sqrt(n) * max|g_ref|,   C_G = 16 (depth and chain-rule slack).
# 2. Parameters after k AdamW steps. Adam is scale-invariant: an element's update is
#    lr * m_hat / sqrt(v_hat), which depends on the *relative* error of its gradient, not the
#    absolute one. An element whose gradient is near the rounding noise (e.g. a key bias,
#    mathematically zero under softmax's shift invariance, or a weight whose sum cancels) can
#    move by anything up to ~lr per step in either run. That is what made a 2e-5 absolute
#    tolerance fail on an AVX-512 machine. Per element i, per step t:
#        |dp_i,t| <= lr * min(2.2, 2 * sqrt(t) * max_{s<=t} atol_g,s / (max_{s<=t} |g_s,i| + eps))
#    (sqrt(v_hat) >= max_s |g_s| / sqrt(t); 2.2 bounds the difference of two updates whose
#    magnitude m_hat/sqrt(v_hat) is at most ~1.1 in the first steps), plus C_P * u * |p| per step
#    for the update arithmetic itself. The bound is summed over the steps taken, using the
#    reference run's own gradients, so an element with a healthy gradient is held to ~1e-9 while
#    only noise-level elements get the ~lr slack that Adam truly allows.
# 3. Losses: forward roundoff C_G * u * sqrt(n) * |L| plus the first-order effect of the
#    parameter bound, sum_i |g_i,t| * bound_i,t-1.
# Grad norms after the first step also feel the Hessian times the parameter difference, which
# is not known here: they keep a relative 1e-4, checked only where the gradients are.
# 4. Exact (full-rank) low-rank compression (tests/compression/lossless.py) rounds once more:
#    a gradient that crosses a compressed message is rebuilt as P Q^T, a sum of r products, so
#    its error is that of one more reduction: `codec_roundings=1` doubles C_G.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
C_G, C_P, ADAM_CAP = 16.0, 4.0, 2.2


def grad_atol(ref: torch.Tensor, tokens: int, dtype=torch.float32, codec_roundings: int = 0) -> float:
    return (1 + codec_roundings) * C_G * UNIT_ROUNDOFF[dtype] * math.sqrt(tokens) * float(ref.abs().max()) if ref.numel() else 0.0


def adam_param_bounds(grad_history: list, params: dict, lr: float, tokens: int, eps: float = 1e-8,
                      dtype=torch.float32, codec_roundings: int = 0) -> tuple:
    """Per-element bounds on |p_layout - p_ref| after len(grad_history) steps (formula 2 above),
    and the bound on each step's loss (formula 3). `grad_history[t]` maps a full (assembled)
    parameter name to the reference's gradient after step t+1; `params` maps it to the
    reference's final parameters."""
    u = UNIT_ROUNDOFF[dtype]
    bounds = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    run_max_g = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    run_max_atol = {n: 0.0 for n in params}
    loss_slack = []
    for t, grads in enumerate(grad_history, start=1):
        slack = 0.0
        for n, p in params.items():
            g = grads.get(n)
            if g is None:
                continue
            g = g.to(torch.float64)
            slack += float((g.abs() * bounds[n]).sum())  # this step's loss feels the earlier drift
            run_max_g[n] = torch.maximum(run_max_g[n], g.abs())
            run_max_atol[n] = max(run_max_atol[n], grad_atol(g, tokens, dtype, codec_roundings))
            ratio = 2 * math.sqrt(t) * run_max_atol[n] / (run_max_g[n] + eps)
            bounds[n] += lr * ratio.clamp(max=ADAM_CAP) + C_P * u * p.abs().to(torch.float64)
        loss_slack.append(slack)
    return bounds, loss_slack


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str):
    """|got - want| <= bound elementwise (bound: float or tensor), with the worst element named."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.to(torch.float64) - want.to(torch.float64)).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    over = diff > bound
    if bool(over.any()):
        i = int(torch.argmax((diff - bound).flatten()))
        raise AssertionError(f"{what}: {int(over.sum())} of {diff.numel()} elements beyond the derived bound; "
                             f"worst at flat index {i}: |diff| {float(diff.flatten()[i]):.3e} > "
                             f"bound {float(bound.flatten()[i]):.3e} (want {float(want.flatten()[i]):.6e})")


def assert_parity(ref_outs: list, outs: list, assemble_fn=None, compare_grads: bool = True, codec_roundings: int = 0):
    """Compare per-rank results of a layout with the reference (both lists of dicts with 'loss',
    'grad_norm', 'grads' (per-step shard dicts), 'params', 'is_last') with the bounds above
    (`codec_roundings`: formula 4)."""
    assemble_fn = assemble_fn or assemble
    last = lambda rs: [o for o in rs if o["is_last"]][0]  # noqa: E731
    ref, got = last(ref_outs), last(outs)
    tokens, lr, eps = ref["tokens"], ref["lr"], ref["eps"]
    steps = len(ref["loss"])
    history = [assemble_fn([o["grads"][t] for o in ref_outs]) for t in range(len(ref_outs[0]["grads"]))]
    ref_p, got_p = assemble_fn([o["params"] for o in ref_outs]), assemble_fn([o["params"] for o in outs])
    assert set(got_p) == set(ref_p)
    assert len(history) == steps, f"the reference must record gradients of all {steps} steps"
    bounds, loss_slack = adam_param_bounds(history, ref_p, lr, tokens, eps, codec_roundings=codec_roundings)
    u = UNIT_ROUNDOFF[torch.float32] * (1 + codec_roundings)
    for t, (lg, lr_) in enumerate(zip(got["loss"], ref["loss"])):
        assert abs(lg - lr_) <= C_G * u * math.sqrt(tokens) * abs(lr_) + loss_slack[t] + 1e-12, \
            f"loss at step {t + 1}: {lg!r} vs {lr_!r} (bound {C_G * u * math.sqrt(tokens) * abs(lr_) + loss_slack[t]:.3e})"
    assert got["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=C_G * u * math.sqrt(tokens) + 1e-7)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    if compare_grads and outs[0]["grads"]:
        got_g = assemble_fn([o["grads"][0] for o in outs])
        assert set(got_g) == set(history[0])
        for name, g in history[0].items():
            assert_within(got_g[name], g, grad_atol(g, tokens, codec_roundings=codec_roundings), f"step-1 grad {name}")
    for name, p in ref_p.items():
        assert_within(got_p[name], p, bounds[name], f"param {name} after {steps} steps")
