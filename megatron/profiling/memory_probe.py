"""What one forward + backward of a module really holds, measured on any device.

Three numbers per run, all in bytes, all relative to the memory live before the forward:

* ``stored``: the unique storages autograd saves for backward (every saved tensor passes a
  `saved_tensors_hooks` pack hook; a view keeps its whole storage, so storages are counted
  once each), minus parameters and the tensors the caller declares shared;
* ``forward_peak``: the highest live allocation during the forward;
* ``backward_peak``: the highest live allocation during the backward, on top of what the
  forward left live (its output and what it stored): the backward working set;
* ``peak``: the highest live allocation over forward + backward together.

CUDA reads the caching allocator's counters (`max_memory_allocated`). A CPU has no allocator
counters, so each phase runs under `torch.profiler` with memory events and the running sum of
allocations and frees is replayed.

This is the measuring side of the profiler (`measure.memory_workload`, which writes the cost
models' memory columns) and of `benchmarks/bench_memory_model.py`: the planners' memory models
are claims about these numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch



def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass
class MemoryProbe:
    stored: int
    forward_peak: int
    live_after_forward: int  # the output and the stored tensors (and anything else kept)
    backward_peak: int  # above live_after_forward

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.live_after_forward + self.backward_peak)


def _phase(device: torch.device, fn: Callable[[], object]):
    """(result, peak above start, net change) of `fn` on `device`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        res = fn()
        torch.cuda.synchronize(device)
        return res, torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start
    box = {}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        box["r"] = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return box["r"], peak, live


def probe(run: Callable[[], torch.Tensor], device: torch.device, exclude: Iterable[torch.Tensor] = (),
          grad: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> MemoryProbe:
    """Run `run()` (returns one tensor) forward, then backward from `grad(out)` (default ones).

    `exclude`: tensors whose storages are not activations (parameters, inputs shared with
    other layers). Gradient buffers of parameters should exist before (see
    `measure._ensure_grads`), so the backward only sees memory that scales with the batch."""
    skip = {_storage_key(t) for t in exclude}
    seen = {}

    def pack(t):
        k = _storage_key(t)
        if k not in skip:
            seen[k] = k[1]  # ints only: holding the tensor would delay its free
        return t

    def fwd():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return run()

    out, f_peak, f_live = _phase(device, fwd)

    def bwd():
        g = grad(out) if grad is not None else torch.ones_like(out)
        out.backward(g)

    _, b_peak, _ = _phase(device, bwd)
    return MemoryProbe(sum(seen.values()), f_peak, f_live, b_peak)

