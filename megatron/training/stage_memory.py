"""Peak memory of every pipeline stage, for the log and TensorBoard (`memory/stage<k>_...`).

Each rank reads its own peak, then one MAX all-reduce over the job gives every stage's peak
(the largest of its data/tensor/context-parallel ranks) on every rank:

* CUDA: `torch.cuda.max_memory_allocated` (the trainer resets it at the start of each step, so
  this is the peak of the last step: weights, gradients, optimizer state and activations);
* CPU: the process's peak resident set (`getrusage` ru_maxrss), since start-up: it includes the
  interpreter and torch's libraries (about 300 MB), and there is no allocator to ask.
"""
from __future__ import annotations

import sys
from typing import List, Tuple

import torch
import torch.distributed as dist


def own_peak_mb(device: torch.device) -> Tuple[str, float]:
    """(what is measured, MiB) for this rank."""
    if device.type == "cuda":
        return "peak_allocated_mb", torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
    return "peak_rss_mb", kb / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)


def stage_peaks_mb(pp_rank: int, pp_size: int, world_size: int, device: torch.device,
                   collective_device: torch.device) -> Tuple[str, List[float]]:
    """(what, [MiB per stage]) on every rank; a collective: every rank calls it at the same step."""
    what, mine = own_peak_mb(device)
    if world_size == 1:  # no collective, and no tensor to read back
        return what, [mine]
    t = torch.zeros(max(1, pp_size), dtype=torch.float64, device=collective_device)
    t[pp_rank] = mine
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return what, [float(x) for x in t.tolist()]  # one read-back per log interval
