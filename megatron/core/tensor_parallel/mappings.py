"""Autograd-aware tensor-parallel communication (Megatron's f/g operators).

Each op is the dual of another in backward: copy <-> all-reduce, split <-> gather. With a
group of one rank (or None) every op is the identity, so TP=1 pays nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives and warns (a FutureWarning per call site and rank, which
# says nothing to a user) on the old names; the same op under whichever name this torch has.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


# Optional replacements for the two tensor-parallel all-reduces, installed by a trainer with
# Optimus-CC's TP compression (megatron/compression/tensor_parallel.py; core does not import
# it): "grad" = the input-gradient all-reduce of column-parallel layers (backward),
# "act" = the output all-reduce of row-parallel layers and the vocabulary-parallel embedding
# (forward). A hook is fn(x, group) -> the (approximate) sum; None keeps the exact all-reduce.
ALL_REDUCE_HOOKS = {"grad": None, "act": None}


def _hooked_all_reduce(kind: str, x: torch.Tensor, group) -> torch.Tensor:
    hook = ALL_REDUCE_HOOKS[kind]
    return _all_reduce(x.clone(), group) if hook is None else hook(x, group)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _hooked_all_reduce("grad", g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _hooked_all_reduce("act", x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


def copy_to_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


# ---------------------------------------------------------------------------------------
# Sequence parallelism: outside the TP regions (norms, dropout, residuals) activations are
# split along the sequence (dim 0 of [s, b, h]); entering a column-parallel linear gathers
# them (backward: reduce-scatter the partial gradients), leaving a row-parallel linear
# reduce-scatters the partial sums (backward: all-gather).

def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism splits the sequence ({x.shape[0]} tokens) over {n} tensor-parallel "
                         f"ranks: make the sequence length a multiple of --tensor-model-parallel-size")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] * n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence parallelism: {x.shape[0]} tokens do not split over {n} tensor-parallel ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x, group=group)
    return out


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_first(g, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.group), None


def scatter_to_sequence_parallel_region(x, group):
    """Full sequence, identical on every TP rank -> this rank's sequence chunk."""
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    """Sequence chunks -> the full sequence on every rank, entering a TP region."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Partial sums over the full sequence -> this rank's chunk of the sum."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
