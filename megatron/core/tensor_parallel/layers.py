"""Column/row-parallel linears and the vocab-parallel embedding.

Weights are initialised from the full (unsharded) tensor drawn from a per-parameter generator
and then sliced, so a TP=2 model holds exactly the halves of the TP=1 model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    group_rank, group_size,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.random import init_generator


def init_full(shape, std: float, seed: int, key: str) -> torch.Tensor:
    # Drawn in float32 whatever the default dtype, so a float64 model (the parity tests) starts
    # from exactly the float32 model's values.
    w = torch.empty(shape, dtype=torch.float32)
    w.normal_(0.0, std, generator=init_generator(seed, key))
    return w.to(torch.get_default_dtype())


def mark_tensor_parallel(param: nn.Parameter, dim: int) -> None:
    """Tag a sharded parameter: grad-norm code counts it on every TP rank, not only rank 0."""
    param.tensor_model_parallel = True
    param.partition_dim = dim


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dimension."""

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, seed: int = 0, key: str = "",
                 skip_bias_add: bool = False, sequence_parallel: bool = False):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and tp > 1
        if out_features % tp != 0:
            raise ValueError(f"{key}: output size {out_features} is not divisible by tensor-parallel size {tp}")
        self.tp_group, self.gather_output, self.skip_bias_add = tp_group, gather_output, skip_bias_add
        self.out_per_rank = out_features // tp
        full = init_full((out_features, in_features), init_std, seed, key + ".weight")
        self.weight = nn.Parameter(full[r * self.out_per_rank:(r + 1) * self.out_per_rank].clone())
        mark_tensor_parallel(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank))
            mark_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        y = F.linear(x, self.weight, bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dimension; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, seed: int = 0, key: str = "",
                 skip_bias_add: bool = False, sequence_parallel: bool = False):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and tp > 1
        if in_features % tp != 0:
            raise ValueError(f"{key}: input size {in_features} is not divisible by tensor-parallel size {tp}")
        self.tp_group, self.input_is_parallel, self.skip_bias_add = tp_group, input_is_parallel, skip_bias_add
        per = in_features // tp
        full = init_full((out_features, in_features), init_std, seed, key + ".weight")
        self.weight = nn.Parameter(full[:, r * per:(r + 1) * per].clone())
        mark_tensor_parallel(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            # Added after the reduce-scatter: each rank sees only its sequence chunk.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary is split across TP ranks."""

    def __init__(self, padded_vocab_size: int, hidden: int, tp_group, *, init_std: float = 0.02,
                 seed: int = 0, key: str = "embedding.word_embeddings", real_vocab_size: Optional[int] = None):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        if padded_vocab_size % tp != 0:
            raise ValueError(f"padded vocabulary {padded_vocab_size} is not divisible by TP {tp}")
        self.tp_group = tp_group
        self.per_rank = padded_vocab_size // tp
        self.start, self.end = r * self.per_rank, (r + 1) * self.per_rank
        # Initialise only the real vocabulary rows the same way for any padding, so that the
        # padded rows (never looked up, logits masked by the data) do not shift the RNG stream.
        real = real_vocab_size or padded_vocab_size
        full = torch.zeros(padded_vocab_size, hidden)
        full[:real] = init_full((real, hidden), init_std, seed, key + ".weight")
        self.weight = nn.Parameter(full[self.start:self.end].clone())
        mark_tensor_parallel(self.weight, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)
