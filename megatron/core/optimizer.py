"""AdamW with Megatron's conventions: no weight decay on biases and norms, optional dynamic loss
scaling (fp16), inf/nan-skipped steps, and clipping by the true global gradient norm.

The global norm counts every parameter exactly once: TP-sharded parameters on every TP rank,
replicated ones (norms, row-parallel biases) only on TP rank 0, and the last stage's copy of a
tied embedding not at all (the first stage counts it).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config.core import TrainingConfig
from megatron.core.comm_device import to_comm
from megatron.core.grad_scaler import DynamicGradScaler
from megatron.core.parallel_state import ParallelState


def param_groups(modules: Iterable[nn.Module], weight_decay: float,
                 decoupled: Optional[tuple] = None) -> List[dict]:
    """Weight-decayed and undecayed groups; with `decoupled` = (max_lr, min_lr) the word
    embedding and output layer get their own group with that curve (Megatron's --decoupled-lr)."""
    decay, no_decay, own = [], [], []
    for m in modules:
        for name, p in m.named_parameters():
            if not p.requires_grad:
                continue
            if decoupled is not None and name.endswith(("word_embeddings.weight", "output_layer.weight")):
                own.append(p)
            else:
                (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if own:
        groups.append({"params": own, "weight_decay": weight_decay, "max_lr": decoupled[0], "min_lr": decoupled[1]})
    return groups


def counts_for_norm(p: nn.Parameter, tp_rank: int) -> bool:
    if getattr(p, "shared_embedding", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or tp_rank == 0


def global_grad_norm_sq(params: Iterable[nn.Parameter], ps: ParallelState) -> torch.Tensor:
    """Squared global norm (float64, on the host). Summed on the gradients' device and read
    back once: a per-parameter read would stall the host once per parameter."""
    params = list(params)
    sq = [p.grad.detach().double().pow(2).sum() for p in params
          if p.grad is not None and counts_for_norm(p, ps.tp_rank) and not getattr(p, "expert_parallel", False)]
    total = torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float64)
    expert = _expert_grad_norm_sq(params, ps)
    if ps.stage_layouts:
        # Stages have their own DP sizes, so no group holds exactly one model replica: every
        # stage's DP rank 0 speaks for its (identical, already reduced) replicas.
        total = to_comm(total)  # (a rank without gradients has a host zero; NCCL takes CUDA only)
        if ps.dp_rank != 0:
            total.zero_()
        dist.all_reduce(total)
    elif ps.mp_group is not None and ps.tp_size * ps.pp_size > 1:
        total = to_comm(total, ps.mp_group)
        dist.all_reduce(total, group=ps.mp_group)
    return total.cpu() if expert is None else total.cpu() + expert


def _expert_grad_norm_sq(params, ps):
    """Experts split over EP ranks (megatron/core/expert_parallel.py): a stage's experts are the
    union over its EP group, and the stages' sums add over the pipeline. Read back to the host once."""
    if ps.ep_size == 1:
        return None
    sq = [p.grad.detach().double().pow(2).sum() for p in params
          if p.grad is not None and getattr(p, "expert_parallel", False)]
    total = torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float64)
    total = to_comm(total, ps.ep_group)
    dist.all_reduce(total, group=ps.ep_group)
    if ps.pp_group is not None and ps.pp_size > 1:
        dist.all_reduce(total, group=ps.pp_group)
    return total.cpu()


class MegatronOptimizer:
    def __init__(self, modules: List[nn.Module], cfg: TrainingConfig, ps: ParallelState,
                 lr_scheduler: "LRScheduler", device: torch.device = torch.device("cpu"),
                 decoupled_lr: Optional[tuple] = None):
        self.cfg, self.ps, self.lr_scheduler = cfg, ps, lr_scheduler
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        if device.type == "cuda":
            kwargs["fused"] = True
        self.optimizer = torch.optim.AdamW(param_groups(modules, cfg.weight_decay, decoupled_lr), **kwargs)
        self.grad_scaler: Optional[DynamicGradScaler] = None
        if cfg.fp16:
            self.grad_scaler = DynamicGradScaler(
                initial_scale=cfg.loss_scale or cfg.initial_loss_scale, min_scale=cfg.min_loss_scale,
                growth_interval=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
                static=cfg.loss_scale is not None)

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def _found_inf(self) -> bool:
        # One device-side reduction and one read back, not one per parameter.
        bad = [torch.isfinite(p.grad).all().logical_not() for p in self.params if p.grad is not None]
        flag = torch.stack(bad).any().float() if bad else torch.zeros((), dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Grads are already DP-reduced, but every rank must agree to skip together (on the
            # backend's device: a host flag fails under NCCL).
            flag = to_comm(flag)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step(self):
        """Returns (applied: bool, grad_norm: float or None)."""
        if self.grad_scaler is not None:
            inv = 1.0 / self.grad_scaler.scale
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(inv)
            found_inf = self._found_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        norm = math.sqrt(global_grad_norm_sq(self.params, self.ps).item())
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            coef = self.cfg.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_scheduler.lr(max_lr=g.get("max_lr"), min_lr=g.get("min_lr"))
        self.optimizer.step()
        return True, norm

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}

    # Per-parameter Adam state ({"step", "exp_avg", "exp_avg_sq"} keyed by id(param)), the
    # layout-free form --ckpt-format torch_dist saves; the distributed optimizer offers the same.
    def param_states(self) -> dict:
        return {id(p): st for p, st in self.optimizer.state.items()}

    def load_param_states(self, states: dict) -> None:
        for p in self.params:
            if id(p) in states:
                self.optimizer.state[p] = states[id(p)]

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.grad_scaler is not None and sd.get("grad_scaler"):
            self.grad_scaler.load_state_dict(sd["grad_scaler"])


def _whole(x: float):
    """`x` as the integer it is meant to be (a sample count reached through a division by the
    global batch and back), else `x`."""
    r = round(x)
    return r if abs(x - r) <= 1e-9 * max(1.0, abs(x)) else x


class LRScheduler:
    """Megatron's OptimizerParamScheduler (the same in Megatron-LM core_v0.9.0 and megatron-core
    0.16.1; tests/training/test_lr_schedule_megatron.py runs both beside this one), counted as
    Megatron counts: in samples. `num_steps` is in iterations of --global-batch-size samples (a
    growing batch advances it by samples / global batch) and `lr` turns it into samples, so each
    value is the same float as Megatron's. Iteration i (from 1) trains with the value after i-1
    steps, as Megatron, whose scheduler steps after the optimizer: linear warm-up from 0 at
    iteration 1 (max_lr * s / W while s <= W), then constant / linear / cosine to min_lr at
    the decay end, or inverse-square-root (min_lr after the decay end, as Megatron)."""

    def __init__(self, cfg: TrainingConfig):
        self.max_lr, self.min_lr = cfg.lr, cfg.min_lr
        self.decay_style = cfg.lr_decay_style
        self.decay_iters = max(cfg.lr_decay_iters or cfg.train_iters, 1)
        self.unit = cfg.global_batch_size or 1  # samples per scheduler step
        self.decay_steps = _whole(self.decay_iters * self.unit)
        if cfg.lr_warmup_fraction is not None:  # a fraction of the decay samples, as Megatron
            self.warmup_steps = cfg.lr_warmup_fraction * self.decay_steps
        else:
            self.warmup_steps = _whole(cfg.lr_warmup_iters * self.unit)
        self.warmup_iters = self.warmup_steps / self.unit
        self.num_steps = 0

    def lr(self, step: Optional[int] = None, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The learning rate at `step`; `max_lr` / `min_lr` give another group's curve of the same
        shape (Megatron's --decoupled-lr / --decoupled-min-lr for the embedding and output layer).
        The arithmetic is Megatron's get_lr, operation for operation (the same rounding)."""
        s = _whole((self.num_steps if step is None else step) * self.unit)
        warmup, decay = self.warmup_steps, self.decay_steps
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if warmup > 0 and s <= warmup:
            return 0.0 + max_lr * float(s) / float(warmup)  # (--lr-warmup-init 0)
        if self.decay_style == "constant":
            return max_lr
        if s > decay:
            return min_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / (max(s, 1) ** 0.5))
        span = decay - warmup
        ratio = 1.0 if span <= 0 else float(s - warmup) / float(span)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment=1):
        self.num_steps += increment

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "decay_style": self.decay_style, "decay_iters": self.decay_iters,
                "warmup_iters": self.warmup_iters}

    def load_state_dict(self, sd):
        self.num_steps = sd["num_steps"]
