"""Helpers for parity tests: train a tiny GPT in any layout, then reassemble full (unsharded,
unpadded) parameters and gradients so layouts can be compared with the single-process run."""
from __future__ import annotations

import re

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
    """What the float32 bound needs to know of a run (see below): the longest reduction (tokens
    summed per step, the FFN width, the padded vocabulary, a key sequence) and the number of
    reductions chained from the loss to a gradient."""
    m = cfg.model
    t5 = m.model_type == "t5"
    seq = m.encoder_seq_length + m.decoder_seq_length if t5 else m.seq_length
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    vocab = -(-m.vocab_size // m.make_vocab_size_divisible_by) * m.make_vocab_size_divisible_by
    layers = (m.encoder_num_layers or m.num_layers) + (m.decoder_num_layers or m.num_layers) if t5 else m.num_layers
    depth = 4 * layers + 4 + (2 * (m.decoder_num_layers or m.num_layers) if t5 else 0)  # + cross-attention
    return {"reduce_len": max(cfg.training.global_batch_size * seq, ffn, vocab, seq, m.hidden_size),
            "depth": depth, "lr": cfg.training.lr, "eps": cfg.training.adam_eps}


# -- tolerances ------------------------------------------------------------------------------
# Why parity runs in float64, and why its bounds hold on every CPU.
#
# Two layouts compute the same mathematics with the same roundings per operation but sum in
# other orders (TP splits, micro-batches, fused vs unfused kernels, AVX-512 vs AVX2 vector widths,
# MKL/oneDNN blocking, thread counts). In float32 the resulting gradient noise (~1e-9 on an
# element whose exact gradient is 0, e.g. a key bias under softmax's shift invariance) is the size
# of AdamW's eps (1e-8), so Adam turns it into an O(lr) move whose sign is the noise's, and a
# parameter bound after k steps must either admit ~lr (and see nothing) or guess how large a given
# CPU's noise is (the "derived" bounds did, with fitted slack constants, and an AMD EPYC with
# AVX-512 crossed them by 1.4x).
#
# In float64 the unit roundoff is u = 2^-53 ~ 1.1e-16, 2^29 ~ 5e8 times smaller, and:
#  * every difference between layouts is first order in u: a length-n sum in ANY order errs by at
#    most gamma_n * sum|terms|, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, 2nd
#    ed., eq. 4.4), so reordering changes a result by at most ~1e-12 * sum|terms| for n <= 10^4;
#  * noise-level gradients are ~1e-17, far below eps, where Adam's update lr*m/(sqrt(v)+eps) is
#    linear in the gradient with slope <= lr/eps = 1e5: such an element moves by <= 1e-12, so
#    Adam no longer amplifies noise into an lr-sized move;
#  * the largest difference any fp32 run showed on any CPU tried (~1.1e-6 on a parameter after 3
#    steps, amplification included) scaled by 2^-29 is ~2e-15.
# A fixed bound RTOL_64 = 1e-9 (relative to each quantity's scale) therefore holds with about
# six orders of magnitude to spare, whatever order a CPU sums in; a changed summation order can
# move a result by a factor of at most sqrt(n) ~ 100 against the typical case. It stays far
# below any real defect: a dropped micro-batch, a missing 1/DP, a stale parameter or a wrong
# learning rate (a 0.01% change is caught: tests/test_parity_utils.py) moves results by >= 1e-7.
# Scales: step-1 gradients by the largest |gradient| of the step over all tensors (an exactly-zero
# gradient's noise is relative to its terms, not to its own value); parameters absolutely (they
# are O(0.02..1)); losses and grad norms relatively.
#
# FP32 (tests marked `fp32`: the float32 path itself). Only what has a proved bound is compared:
# the first step's loss, grad norm and gradients, with the worst-case (order-independent) bound
# of D chained reductions of at most N terms each, D * gamma_N relative to the step's gradient
# scale (N: the longest reduction, D: 4 per layer and 4 for embedding, final norm and loss).
# Parameters after Adam steps are not compared in float32: no bound independent of the CPU exists
# there (see above), and the float64 tests cover them.
#
# Exact (full-rank) low-rank compression (tests/compression/lossless.py) rounds once more: a
# gradient that crosses a compressed message is rebuilt as P Q^T from a QR in the run's dtype;
# `codec_roundings` adds one more chained reduction per rounding to the fp32 bound.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
RTOL_64 = 1e-9


def gamma(n: int, dtype=torch.float32) -> float:
    """Worst-case relative error of a length-n sum in any order (Higham's gamma_n)."""
    nu = n * UNIT_ROUNDOFF[dtype]
    assert nu < 0.5, f"gamma_{n} is meaningless in {dtype}"
    return nu / (1 - nu)


def fp32_rtol(cfg_or_out: dict, codec_roundings: int = 0) -> float:
    """D * gamma_N for the float32 comparisons (see above), from a result's `reduce_len`/`depth`."""
    return (cfg_or_out["depth"] + codec_roundings) * gamma(cfg_or_out["reduce_len"])


def run_dtype(outs: list) -> torch.dtype:
    """The dtype the runs trained in: that of their parameters."""
    for o in outs:
        for t, _, _ in o["params"].values():
            return t.dtype
    raise AssertionError("no parameters recorded")


def _step_scale(grads: dict) -> float:
    return max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str):
    """|got - want| <= bound elementwise (bound: float or tensor), with the worst element named."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.to(torch.float64) - want.to(torch.float64)).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    _record_margin(what, diff, bound)
    over = diff > bound
    if bool(over.any()):
        i = int(torch.argmax((diff - bound).flatten()))
        raise AssertionError(f"{what}: {int(over.sum())} of {diff.numel()} elements beyond the bound; "
                             f"worst at flat index {i}: |diff| {float(diff.flatten()[i]):.3e} > "
                             f"bound {float(bound.flatten()[i]):.3e} (want {float(want.flatten()[i]):.6e})")


_MARGINS: list = []


def _record_margin(what: str, diff: torch.Tensor, bound: torch.Tensor) -> None:
    # PARITY_MARGINS=<file>: append the worst diff/bound ratio of each assertion (how much room
    # the bounds leave; reported in docs/parity.md). Off by default.
    import os
    path = os.environ.get("PARITY_MARGINS")
    if not path or not diff.numel():
        return
    ratio = diff / bound.clamp_min(1e-300)
    i = int(torch.argmax(ratio.flatten()))
    import json
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "what": what, "ratio": float(ratio.flatten()[i]),
                            "diff": float(diff.flatten()[i]), "bound": float(bound.flatten()[i])}) + "\n")


def _assert_scalar(got: float, want: float, bound: float, what: str) -> None:
    assert_within(torch.tensor([got]), torch.tensor([want]), bound, what)


def assert_parity(ref_outs: list, outs: list, assemble_fn=None, compare_grads: bool = True, codec_roundings: int = 0):
    """Compare per-rank results of a layout with the reference (both lists of dicts with 'loss',
    'grad_norm', 'grads' (per-step shard dicts), 'params', 'is_last') with the bounds above. Both
    must have trained in the same dtype; float64 compares every step and the final parameters,
    float32 the first step only (`codec_roundings`: extra roundings of a lossless codec)."""
    assemble_fn = assemble_fn or assemble
    last = lambda rs: [o for o in rs if o["is_last"]][0]  # noqa: E731
    ref, got = last(ref_outs), last(outs)
    dtype = run_dtype(ref_outs)
    assert run_dtype(outs) == dtype, f"the layout trained in {run_dtype(outs)}, the reference in {dtype}"
    steps = len(ref["loss"])
    assert len(got["loss"]) == steps, f"{len(got['loss'])} steps against the reference's {steps}"
    ref_g1 = assemble_fn([o["grads"][0] for o in ref_outs]) if ref_outs[0]["grads"] else None
    if dtype == torch.float64:
        rtol = RTOL_64
        loss_steps, norm_steps = range(steps), range(steps)
    else:
        rtol = fp32_rtol(ref, codec_roundings)
        loss_steps, norm_steps = range(1), range(1)
    for t in loss_steps:
        _assert_scalar(got["loss"][t], ref["loss"][t], rtol * abs(ref["loss"][t]), f"loss at step {t + 1}")
    for t in norm_steps:
        _assert_scalar(got["grad_norm"][t], ref["grad_norm"][t], rtol * abs(ref["grad_norm"][t]),
                       f"grad norm at step {t + 1}")
    if compare_grads and outs[0]["grads"]:
        assert ref_g1 is not None, "the reference must record its step-1 gradients"
        got_g = assemble_fn([o["grads"][0] for o in outs])
        assert set(got_g) == set(ref_g1)
        scale = _step_scale(ref_g1)
        for name, g in ref_g1.items():
            assert_within(got_g[name], g, rtol * scale, f"step-1 grad {name}")
    if dtype == torch.float64:
        ref_p, got_p = assemble_fn([o["params"] for o in ref_outs]), assemble_fn([o["params"] for o in outs])
        assert set(got_p) == set(ref_p)
        for name, p in ref_p.items():
            assert_within(got_p[name], p, RTOL_64, f"param {name} after {steps} steps")
