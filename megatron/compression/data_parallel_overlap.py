"""--overlap-grad-reduce with --grad-comp: PowerSGD's data-parallel reduction, half of it
during the backward passes.

PowerSGD needs two dependent all-reduces per matrix: P = sum_k M_k Q, then (P orthonormalised)
Q = sum_k M_k^T P. The first only needs the matrix's final gradient, so it starts, bucket by
bucket, as soon as a bucket's gradients are final (the plain overlapped reducer's rule, which
it inherits): one all-reduce per bucket of its matrices' M Q and its vectors (biases, norms)
uncompressed. The second needs every P of the step orthonormalised; it runs for all matrices
at once after the backward, as in the non-overlapped reducer. The arithmetic and the state's
keys (a gradient's position in the reduced list) are the non-overlapped reducer's, so a run
may switch the flag between a checkpoint and its resume. Warm-up steps (--grad-comp-warm-up)
and stages that --selective-grad-comp leaves uncompressed run the plain overlapped all-reduce.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megatron.compression.data_parallel import PowerSGDReducer
from megatron.compression.stats import Timer
from megatron.core.distributed import OverlappedGradReducer


class OverlappedPowerSGD(OverlappedGradReducer):
    all_reduces = True  # leaves DP sums on every rank (a distributed optimizer only cuts its shard)

    def __init__(self, params: Iterable[nn.Parameter], reducer: PowerSGDReducer, bucket_numel: int):
        super().__init__(params, reducer.dp_group, reducer.dp_size, bucket_numel)
        self.reducer = reducer
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.iteration = 0
        self.sent = (0, 0)  # (bytes sent, bytes of an uncompressed all-reduce) of the last step

    def start_iteration(self, expected_per_param: dict, iteration: int = 0) -> None:
        super().start_iteration(expected_per_param, iteration)
        self.iteration = iteration

    def _compressing(self) -> bool:
        return self.reducer.active(self.iteration)

    def _launch(self, i: int) -> None:
        if not self._compressing():
            return super()._launch(i)
        bucket = self.buckets[i]
        vectors, mats = self.reducer.split([p.grad for p in bucket], [self.index[id(p)] for p in bucket])
        local = self.reducer.local_p(mats, self.iteration)
        flat = torch.cat([v.reshape(-1) for v in vectors] + [p.reshape(-1) for p in local])
        self.works[i] = (dist.all_reduce(flat, group=self.dp_group, async_op=True), flat, vectors, mats, local)

    def finish(self) -> None:
        if not (self.dp_size > 1 and self.dp_group is not None):
            return
        raw = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        if not self._compressing():
            super().finish()
            self.sent = (raw, raw)
            return
        self.active = False
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.works[i] is None:
                self._launch(i)
        sent, all_mats, summed = 0, [], []
        for i in range(len(self.buckets)):
            work, flat, vectors, mats, local = self.works[i]
            work.wait()
            off = 0
            for v in vectors:
                v.copy_(flat[off:off + v.numel()].view_as(v))
                off += v.numel()
                sent += v.numel() * v.element_size()
            for p in local:
                summed.append(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            all_mats += mats
        self.works = [None] * len(self.buckets)
        true = self.reducer.true_sums(all_mats)
        timer = (Timer(all_mats[0][2].device) if self.reducer.stats is not None and all_mats
                 else contextlib.nullcontext())
        with timer:
            if all_mats:
                sent += self.reducer.finish_compress(all_mats, summed)
        self.reducer.record_stats(all_mats, true, getattr(timer, "seconds", 0.0))
        self.sent = (sent, raw)
