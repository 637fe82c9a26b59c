"""Run settings that Megatron-LM users pass every day and that change nothing the model, the
parallel layout or the checkpoint's layout depend on: wall-clock exit, logging extras, manual GC,
a growing global batch, a decoupled learning rate for the embedding and output layer.

They ride beside `MegatronConfig` (as `cfg.extras`, set by the CLI) rather than inside it, so a
checkpoint's stored configuration, and the resume checks that compare it, do not change."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config.errors import _require


@dataclasses.dataclass
class ExtrasConfig:
    exit_duration_in_mins: Optional[float] = None  # save (with --save) and stop after this much training time
    log_params_norm: bool = False  # the global parameter norm on the log line and in TensorBoard
    log_num_zeros_in_grad: bool = False  # gradient entries that are exactly 0, before clipping
    tensorboard_log_interval: int = 1  # per-iteration scalars every N iterations
    manual_gc: bool = False  # Python's collector off; collect every manual_gc_interval iterations
    manual_gc_interval: int = 0  # 0: never during training
    manual_gc_eval: bool = True  # collect before and after each evaluation
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    decoupled_lr: Optional[float] = None  # the word embedding's and output layer's peak learning rate
    decoupled_min_lr: Optional[float] = None
    batch_schedule: Optional[object] = None  # megatron.config.batch_schedule.BatchSchedule (growing global batch)

    def __post_init__(self):
        _require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")
        _require(self.tensorboard_log_interval > 0,
                 f"--tensorboard-log-interval must be positive, got {self.tensorboard_log_interval}")
        _require(self.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")


def extras_of(cfg) -> ExtrasConfig:
    """The run's extras; defaults for a configuration built in code (tests, tools)."""
    return getattr(cfg, "extras", None) or ExtrasConfig()
