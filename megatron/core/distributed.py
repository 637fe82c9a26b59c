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


def allreduce_data_parallel_grads(params: Iterable[nn.Parameter], dp_group, dp_size: int,
                                  bucket_numel: int = BUCKET_NUMEL) -> None:
    if dp_size == 1 or dp_group is None:
        return
    grads = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    _bucketed_all_reduce(grads, dp_group, bucket_numel)


def allreduce_embedding_grads(tied_params: List[nn.Parameter], embedding_group) -> None:
    """Sum the gradients of the first stage's word embedding and the last stage's copy."""
    if embedding_group is None:
        return
    for p in tied_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=embedding_group)


def allreduce_resharded_embedding_grads(tied_params: List[nn.Parameter], embedding_group, tp_rank: int,
                                        vocab_rows: int, reduce=None) -> int:
    """Tied-embedding sync when the first and last stage have different TP or DP sizes (their
    vocabulary shards differ): every rank of both stages writes its shard's gradient into a
    zero [vocab_rows, h] buffer at its rows (vocabulary row v is token v on both stages), one
    all-reduce sums them, each rank takes its rows back. Run *before* the data-parallel
    reduction and leave the tied parameters out of it: the sum already spans every DP replica
    of both stages. Returns the payload bytes. `reduce(fulls) -> bytes`, if given, sums the
    zero-padded buffers over the group in its own way (--emb-grad-comp's low-rank reducer)."""
    if embedding_group is None:
        return 0
    fulls = []
    for p in tied_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        rows = p.shape[0]
        full = torch.zeros((vocab_rows,) + tuple(p.shape[1:]), dtype=p.grad.dtype, device=p.grad.device)
        full[tp_rank * rows:(tp_rank + 1) * rows] = p.grad
        fulls.append(full)
    if reduce is not None:
        sent = reduce(fulls)
    else:
        sent = 0
        for full in fulls:
            dist.all_reduce(full, group=embedding_group)
            sent += full.numel() * full.element_size()
    for p, full in zip(tied_params, fulls):
        rows = p.shape[0]
        p.grad.copy_(full[tp_rank * rows:(tp_rank + 1) * rows])
    return sent


def allreduce_replicated_grads(params: List[nn.Parameter], group, contribute: bool) -> None:
    """Sum of a tied parameter that every TP rank holds whole (T5's learned position table) over
    `group` = every TP and DP rank of the stages holding it, when those stages have their own
    TP/DP sizes: one TP rank per replica contributes (`contribute`), the others add zeros, so each
    replica's gradient counts once. Like the resharded sync, it spans the DP replicas already."""
    if group is None:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if not contribute:
            p.grad.zero_()
        dist.all_reduce(p.grad, group=group)


class OverlappedGradReducer:
    """`--overlap-grad-reduce`: the data-parallel all-reduce of a bucket starts while the
    backward passes still run, as soon as every gradient in it is final.

    "Final" comes from the plan: a stage's parameters accumulate once per BackwardPass of that
    stage, so the trainer hands over the expected counts before the executor runs
    (`start_iteration`). Buckets hold parameters in reverse order (the last layers' gradients
    are final first) and are launched strictly in bucket order, so every DP rank issues the
    same collectives in the same order even when their plans differ (DynaPipe); a bucket
    whose gradients never became final (a parameter unused in some backward) is reduced by
    `finish`. All reductions are sums, so running this before the tied-embedding and
    sequence-parallel sums gives the same result as after them.
    """

    def __init__(self, params: Iterable[nn.Parameter], dp_group, dp_size: int, bucket_numel: int = BUCKET_NUMEL,
                 optimizer=None):
        """`optimizer`: a `DistributedOptimizer` whose buckets this reducer reduce-scatters
        (`launch_reduce` / `complete_reduce`) instead of all-reducing its own; its late buckets
        (gradients other syncs still change) are left to the optimizer's step."""
        self.params = [p for p in params if p.requires_grad]
        self.dp_group, self.dp_size = dp_group, dp_size
        self.optimizer = optimizer
        self.buckets: List[List[nn.Parameter]] = []
        self.late: set = set()
        if optimizer is not None:
            self.buckets = [list(b.params) for b in optimizer.buckets]
            self.late = set(optimizer.late_buckets)
            self.params = [p for b in self.buckets for p in b]
        cur, size = [], 0
        for p in reversed(self.params if optimizer is None else []):
            if cur and (size + p.numel() > bucket_numel or p.dtype != cur[0].dtype):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel()
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.expected: dict = {}
        self.seen: dict = {}
        self.pending = [0] * len(self.buckets)
        self.works: list = [None] * len(self.buckets)
        self.next_bucket = 0
        self.active = False
        self.overlapped = 0  # buckets launched during the backward passes (for the log/benchmark)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def start_iteration(self, expected_per_param: dict, iteration: int = 0) -> None:
        """`expected_per_param`: id(param) -> number of gradient accumulations this iteration;
        `iteration` (1-based) is for reducers whose method changes with it (warm-up)."""
        self.expected = expected_per_param
        self.seen = {}
        self.pending = [sum(1 for p in b if expected_per_param.get(id(p), 0) > 0) if i not in self.late else -1
                        for i, b in enumerate(self.buckets)]
        self.works = [None] * len(self.buckets)
        self.next_bucket = 0
        self.overlapped = 0
        self.active = self.dp_size > 1 and self.dp_group is not None

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        k = id(p)
        n = self.seen.get(k, 0) + 1
        self.seen[k] = n
        if n == self.expected.get(k, -1):
            b = self.bucket_of[k]
            self.pending[b] -= 1
            while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0 \
                    and all(q.grad is not None for q in self.buckets[self.next_bucket]):
                self._launch(self.next_bucket)
                self.overlapped += 1
                self.next_bucket += 1

    def _launch(self, i: int) -> None:
        grads = [p.grad for p in self.buckets[i]]
        if self.optimizer is not None:
            self.works[i] = self.optimizer.launch_reduce(i, grads)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.works[i] = (dist.all_reduce(flat, group=self.dp_group, async_op=True), flat)

    def finish(self) -> None:
        """Wait for launched buckets, reduce the rest (in order), write the sums back."""
        if not (self.dp_size > 1 and self.dp_group is not None):
            return
        self.active = False
        if self.optimizer is not None:
            # Reduce-scattered buckets go to the optimizer; it reduces the rest in its step,
            # after the tied-embedding / sequence-parallel syncs, in bucket order.
            for i, work in enumerate(self.works):
                if work is not None:
                    self.optimizer.complete_reduce(i, work)
            self.works = [None] * len(self.buckets)
            return
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.works[i] is None:
                self._launch(i)
        for i, bucket in enumerate(self.buckets):
            work, flat = self.works[i]
            work.wait()
            off = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
        self.works = [None] * len(self.buckets)
