"""Gradient reduction after the pipeline: data-parallel sum and tied-embedding sync.

The loss is already normalised by the number of loss tokens in the whole global batch, so
data-parallel gradients are summed, not averaged: the result equals one big-batch step.
Gradients are flattened into buckets so gloo/NCCL see few large messages.
"""
from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist
from torch import nn

BUCKET_NUMEL = 40_000_000


def _bucketed_all_reduce(grads: List[torch.Tensor], group, bucket_numel: int = BUCKET_NUMEL) -> None:
    bucket, size = [], 0
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket, size = [], 0
        for g in same:
            bucket.append(g)
            size += g.numel()
            if size >= bucket_numel:
                _reduce_bucket(bucket, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: List[torch.Tensor], group) -> None:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def allreduce_data_parallel_grads(params: Iterable[nn.Parameter], dp_group, dp_size: int) -> None:
    if dp_size == 1 or dp_group is None:
        return
    grads = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    _bucketed_all_reduce(grads, dp_group)


def allreduce_embedding_grads(tied_params: List[nn.Parameter], embedding_group) -> None:
    """Sum the gradients of the first stage's word embedding and the last stage's copy."""
    if embedding_group is None:
        return
    for p in tied_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=embedding_group)
