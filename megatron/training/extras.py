"""Run extras of `megatron.config.extras.ExtrasConfig` at training time: manual GC, the
wall-clock exit, the parameter norm and the zero count of the gradients, Weights & Biases."""
from __future__ import annotations

import gc
import sys
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron.config.extras import ExtrasConfig


def _model_parallel_sum(total: torch.Tensor, ps) -> torch.Tensor:
    """Sum over the ranks that hold one model replica (as the gradient norm is summed)."""
    if ps.stage_layouts:
        if ps.dp_rank != 0:
            total.zero_()
        dist.all_reduce(total)
    elif ps.mp_group is not None and ps.tp_size * ps.pp_size > 1:
        dist.all_reduce(total, group=ps.mp_group)
    return total


def _counted(params: Iterable, ps):
    from megatron.core.optimizer import counts_for_norm
    return [p for p in params if counts_for_norm(p, ps.tp_rank)]


def params_norm(params: Iterable, ps) -> float:
    """Global L2 norm of the parameters, each counted once (Megatron's calc_params_l2_norm)."""
    sq = [p.detach().double().pow(2).sum() for p in _counted(params, ps)]
    total = torch.stack(sq).sum().cpu() if sq else torch.zeros((), dtype=torch.float64)
    return float(_model_parallel_sum(total, ps).sqrt())


def num_zeros_in_grad(params: Iterable, ps) -> int:
    """Gradient entries that are exactly zero, over the whole model (Megatron's count_zeros_fp32)."""
    n = [(p.grad == 0).sum().double() for p in _counted(params, ps) if p.grad is not None]
    total = torch.stack(n).sum().cpu() if n else torch.zeros((), dtype=torch.float64)
    return int(_model_parallel_sum(total, ps))


class RunExtras:
    def __init__(self, extras: ExtrasConfig, ps, collective_device):
        self.cfg, self.ps, self.device = extras, ps, collective_device
        self.start = time.monotonic()

    def begin(self) -> None:
        self.start = time.monotonic()
        if self.cfg.manual_gc:
            gc.disable()
            gc.collect()

    def finish(self) -> None:
        if self.cfg.manual_gc:
            gc.enable()

    def around_eval(self) -> None:
        if self.cfg.manual_gc and self.cfg.manual_gc_eval:
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.cfg.manual_gc and self.cfg.manual_gc_interval and iteration % self.cfg.manual_gc_interval == 0:
            gc.collect()

    def out_of_time(self) -> bool:
        """--exit-duration-in-mins: True on every rank once any rank has trained that long (one
        all-reduce per iteration, so that all ranks stop after the same iteration)."""
        limit = self.cfg.exit_duration_in_mins
        if limit is None:
            return False
        flag = torch.tensor([1.0 if time.monotonic() - self.start > 60.0 * limit else 0.0], device=self.device)
        if dist.is_initialized() and self.ps.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


class WandbWriter:
    """Scalars to Weights & Biases when --wandb-project is given and wandb is installed."""

    def __init__(self, extras: ExtrasConfig, config: dict):
        self.run = None
        if not extras.wandb_project:
            return
        try:
            import wandb
        except ImportError:
            print(f"warning: --wandb-project {extras.wandb_project} given but wandb is not installed "
                  "(pip install '.[wandb]'); W&B logging is off", file=sys.stderr, flush=True)
            return
        kw = dict(project=extras.wandb_project, name=extras.wandb_exp_name, config=config)
        if extras.wandb_save_dir:
            import os
            os.makedirs(extras.wandb_save_dir, exist_ok=True)
            kw["dir"] = extras.wandb_save_dir
        self.run = wandb.init(**kw)

    def log(self, scalars: dict, iteration: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in scalars.items() if v is not None}, step=iteration)

    def close(self) -> Optional[None]:
        if self.run is not None:
            self.run.finish()
            self.run = None
