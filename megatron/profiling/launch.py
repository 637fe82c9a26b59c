"""Run `profile_rank` on TP ranks: one spawned process per rank (megatron.core.launch), gloo on CPU,
NCCL on CUDA.

Spawn rather than fork: the parent may already have used OpenMP (tests, notebooks) and
libgomp does not survive a fork with its thread pool started. Rank 0's numbers are kept (the
collectives inside every layer keep the ranks in lock-step, so the ranks time the same thing).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import launch
from megatron.core.parallel_state import ParallelState


def _profile_on_rank(rank, tp, spec, profile_rank):
    if spec.device.startswith("cuda"):
        spec.device = f"cuda:{rank}"
    group = dist.new_group(list(range(tp)))
    ps = ParallelState(world_size=tp, rank=rank, tp_size=tp, tp_rank=rank, tp_group=group,
                       tp_global_ranks=list(range(tp)))
    dev = torch.device(spec.device)

    def agree(flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item() > 0)

    log = launch.post if rank == 0 else (lambda s: None)
    out = profile_rank(spec, ps, agree=agree, log=log)
    return out if rank == 0 else None


def run_tp_ranks(spec, tp: int, log, profile_rank, timeout_s: float = 3600.0) -> dict:
    """`profile_rank(spec, ps, agree=, log=)` (a module-level function: it travels to spawned
    processes by name; the profiler passes its own, so this module does not import it) on `tp`
    ranks; returns rank 0's result. Raises RuntimeError with the
    failing rank's traceback, or naming the dead rank."""
    cuda = spec.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < tp:
        raise RuntimeError(f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    return launch.run_ranks(_profile_on_rank, tp, spec, profile_rank, timeout_s=timeout_s, start="spawn",
                            backend="nccl" if cuda else "gloo", threads=None if cuda else spec.cpu_threads,
                            on_message=lambda rank, line: log(line), join_s=10.0,
                            what=f"profiling with --tp {tp}")[0]
