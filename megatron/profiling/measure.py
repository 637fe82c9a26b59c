"""Measure one shape: forward/backward time, activation memory kept for backward, transient peak.

The unit measured is a `Workload`: a module run forward on freshly made inputs and then
backward from an output gradient. Three kinds of numbers come out:

* time: warm-up iterations, then the median of N timed ones (device synchronised around each
  phase, so asynchronous CUDA kernels are inside the interval they belong to);
* stored bytes: every tensor autograd saves for backward passes through a
  `saved_tensors_hooks` pack hook; summing the *unique storages* (a view keeps its whole
  storage alive) minus parameters and declared shared inputs gives what the layers keep.
  This works on every device because it needs no allocator statistics;
* peak bytes: the highest allocation above the starting point during one forward+backward.
  CUDA: `torch.cuda.max_memory_allocated`. CPU has no allocator counters, so the same pass
  runs under `torch.profiler` with memory events and the running sum of allocations is replayed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from megatron.profiling import noise
from megatron.profiling.memory_probe import probe


class ShapeInfeasible(Exception):
    """The shape does not fit (out of memory, or past a configured cap); recorded as null."""


@dataclass
class Workload:
    """`make_inputs()` makes fresh inputs for `run(*inputs)`, which returns one tensor to run
    backward from. `owned_input(inputs)` is the input the first measured layer owns (it is not
    allocated inside the pass, so the peak adds it back); `shared(inputs)` lists inputs no
    measured layer owns (T5: the encoder output every decoder layer reads), left out of
    the stored bytes."""
    module: torch.nn.Module
    make_inputs: Callable[[], Sequence[torch.Tensor]]
    run: Callable[..., torch.Tensor]
    owned_input: Callable[[Sequence[torch.Tensor]], Optional[torch.Tensor]] = lambda ins: ins[0]
    shared: Callable[[Sequence[torch.Tensor]], List[torch.Tensor]] = lambda ins: []


@dataclass
class Result:
    forward_ms: float
    backward_ms: float
    stored_bytes: int  # saved for backward, all measured layers together
    peak_bytes: int  # highest live activation memory during forward+backward, inputs included
    timing: Optional[noise.Timing] = None  # spread and rounds of the time (profiling/noise.py)
    # The split backward's halves (profiling/weight_pass.py), where the profiler timed them.
    input_grad_ms: float = float("nan")
    weight_grad_ms: float = float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ensure_grads(module: torch.nn.Module) -> None:
    # Gradient buffers are model state, not activations: allocate them before measuring so
    # the peak only sees memory that scales with the micro-batch.
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


STATISTICS = noise.STATISTICS


def time_cell(w: Workload, device: torch.device, warmup: int, iters: int,
              max_seconds: Optional[float], agree: Callable[[bool], bool] = lambda x: x,
              statistic: str = "median", max_spread: float = float("inf"),
              remeasure: int = 0) -> noise.Timing:
    """Forward and backward ms of the workload as a `noise.Timing` (statistic over the timed
    iterations, their spread, re-measured past `max_spread`). Raises ShapeInfeasible past
    `max_seconds` for one forward+backward, judged on the first iteration; `agree` makes every
    TP rank take the same decisions (one rank leaving while the others enter a collective would hang)."""
    first = [True]

    def sample(i):
        inputs = w.make_inputs()
        _sync(device)
        t0 = noise.clock()
        out = w.run(*inputs)
        _sync(device)
        t1 = noise.clock()
        out.backward(torch.ones_like(out))
        _sync(device)
        t2 = noise.clock()
        if first[0] and max_seconds is not None and agree(t2 - t0 > max_seconds):
            raise ShapeInfeasible(f"one forward+backward took over --max-seconds-per-shape {max_seconds}s")
        first[0] = False
        del out, inputs
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    return noise.repeat(sample, warmup, iters, statistic=statistic, max_spread=max_spread,
                        remeasure=remeasure, agree=agree)


def time_workload(w: Workload, device: torch.device, warmup: int, iters: int,
                  max_seconds: Optional[float], agree: Callable[[bool], bool] = lambda x: x,
                  statistic: str = "median") -> tuple:
    """(forward ms, backward ms): median (or min) over the timed iterations (`time_cell`, once)."""
    return time_cell(w, device, warmup, iters, max_seconds, agree, statistic).values


def memory_workload(w: Workload, device: torch.device) -> tuple:
    """(stored bytes, peak bytes) of one forward+backward, by `memory_probe.probe` (the one
    meter of the profiler and of benchmarks/bench_memory_model.py). An input the workload owns
    (the layer's own input activation) counts in the peak: it was allocated before the probe."""
    inputs = w.make_inputs()
    m = probe(lambda: w.run(*inputs), device, exclude=[*w.module.parameters(), *w.shared(inputs)])
    owned = w.owned_input(inputs)
    return m.stored, m.peak + (owned.untyped_storage().nbytes() if owned is not None else 0)


def measure(w: Workload, device: torch.device, warmup: int, iters: int,
            max_seconds: Optional[float] = None, agree: Callable[[bool], bool] = lambda x: x,
            statistic: str = "median", max_spread: float = float("inf"), remeasure: int = 0) -> Result:
    """Time and memory of one shape. Raises ShapeInfeasible when it does not fit."""
    try:
        _ensure_grads(w.module)
        t = time_cell(w, device, warmup, iters, max_seconds, agree, statistic, max_spread, remeasure)
        f, b = t.values
        stored, peak = memory_workload(w, device)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        raise ShapeInfeasible(f"CUDA out of memory: {str(e).splitlines()[0]}") from None
    except RuntimeError as e:
        if "can't allocate memory" in str(e) or "out of memory" in str(e):
            raise ShapeInfeasible(f"out of memory: {str(e).splitlines()[0]}") from None
        raise
    return Result(f, b, stored, peak, t)
