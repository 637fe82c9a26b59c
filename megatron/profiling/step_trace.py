"""`--profile`: a torch.profiler Chrome trace of training iterations, as Megatron-LM's
`--profile --use-pytorch-profiler` writes it.

Iterations `--profile-step-start` <= i < `--profile-step-end` are recorded (CPU activities, and
CUDA kernels when the run is on a GPU) on each rank of `--profile-ranks`, into
`--profile-dir` (default `--tensorboard-dir`) as `trace_rank<R>_iters<N>-<M>.json`.
Open it in https://ui.perfetto.dev or chrome://tracing; TensorBoard's profiler plugin reads the
same folder. A run that ends inside the window still writes what it recorded.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.atomic import atomic_path


class StepProfiler:
    def __init__(self, logging_cfg, rank: int, device: torch.device):
        c = logging_cfg
        self.enabled = bool(c.profile) and rank in c.profile_ranks
        self.start, self.end = c.profile_step_start, c.profile_step_end
        self.folder = c.profile_dir or c.tensorboard_dir
        self.rank, self.device = rank, device
        self.prof: Optional[torch.profiler.profile] = None
        self.path: Optional[str] = None
        self._last = None
        self._span = None

    def before_step(self, iteration: int) -> None:
        """Call with the iteration about to run (1-based)."""
        if not self.enabled or not (self.start <= iteration < self.end):
            return
        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.first = iteration
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
        # One named span per iteration, so the trace shows where each step begins and ends.
        self._span = torch.profiler.record_function(f"iteration {iteration}")
        self._span.__enter__()

    def after_step(self, iteration: int) -> None:
        if self.prof is None:
            return
        self._span.__exit__(None, None, None)
        self._span = None
        self._last = iteration
        if iteration + 1 >= self.end:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when training stops inside the window)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self._span is not None:  # a step that raised inside the window
            self._span.__exit__(None, None, None)
            self._span = None
        prof.__exit__(None, None, None)
        if self._last is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"trace_rank{self.rank}_iters{self.first}-{self._last}.json")
        with atomic_path(path) as tmp:  # never a half-written trace under the final name
            prof.export_chrome_trace(tmp)
        self.path = path
        print(f"rank {self.rank}: wrote torch.profiler trace of iterations {self.first}-{self._last} to {path}",
              flush=True)
