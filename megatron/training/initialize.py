"""torchrun environment -> process group, parallel groups, seeds, device."""
from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.config.core import MegatronConfig
from megatron.core.host_memory import keep_freed_host_memory
from megatron.core.parallel_state import ParallelState, initialize_heterogeneous_parallel, initialize_model_parallel
from megatron.core.tensor_parallel.random import model_parallel_seed


def initialize_megatron(cfg: MegatronConfig) -> Tuple[ParallelState, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world != cfg.parallel.world_size:
        raise RuntimeError(f"WORLD_SIZE={world} but the configuration was built for {cfg.parallel.world_size} ranks")
    use_cuda = torch.cuda.is_available()
    backend = cfg.parallel.distributed_backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise RuntimeError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        keep_freed_host_memory()
    if not use_cuda and "OMP_NUM_THREADS" not in os.environ and world > 1:
        # Several ranks on one host each defaulting to all cores slow down ~4x (oversubscription).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if use_cuda else None)
    ps = initialize_parallel(cfg, timeout)
    set_seeds(cfg.training.seed, ps, device)
    return ps, device


def initialize_parallel(cfg: MegatronConfig, timeout: timedelta) -> ParallelState:
    """Process groups for the configured layout (uniform, or per-stage TP x DP sizes)."""
    if cfg.parallel.stage_parallel is not None:
        return initialize_heterogeneous_parallel(cfg.parallel.stage_parallel, timeout)
    ps = initialize_model_parallel(cfg.parallel.tensor_model_parallel_size,
                                   cfg.parallel.pipeline_model_parallel_size, timeout,
                                   cp_size=cfg.parallel.context_parallel_size)
    if cfg.data.dynapipe_cp_sizes:  # the CP size chosen per micro-batch: nested CP sub-groups
        from megatron.core.parallel_state import add_nested_cp_groups
        add_nested_cp_groups(ps, cfg.data.dynapipe_cp_sizes)
    if cfg.model.moe is not None:
        from megatron.core.expert_parallel import add_expert_groups
        add_expert_groups(ps, cfg.model.moe.expert_model_parallel_size)
    return ps


def set_seeds(seed: int, ps: ParallelState, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed, ps.tp_rank, ps.pp_rank, device.type)
