"""Batch samplers: Megatron's fixed-size pretraining sampler and a token-budget sampler."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


class MegatronPretrainingSampler:
    """Sequential micro-batches for one data-parallel rank, resumable (Megatron semantics).

    Samples consumed_samples, consumed_samples + 1, ... are grouped into chunks of
    micro_batch_size * data_parallel_size; rank r gets slice [r*mbs, (r+1)*mbs) of each.
    `consumed_samples` is the global count saved in checkpoints, so a resumed run
    continues exactly where it stopped, whatever the DP size.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must be in [0, {total_samples}) "
                             "(checkpoint from a longer run than the dataset?)")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        lo, hi = self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.step:
                yield batch[lo:hi]
                batch = []
        if batch and not self.drop_last:
            yield batch[lo:hi]


class TokenBudgetSampler:
    """Global batches in data order whose token count stays within a budget (DynaPipe).

    Each sample counts min(length, max_seq_length) tokens (longer ones are truncated to
    --seq-length by the collate).  Samples are taken in order until the next one would
    exceed tokens_per_global_batch; that batch is yielded as a list of sample indices.
    Resume: pass the saved `consumed_samples` (the number of samples in all batches
    yielded so far, also kept in `state_dict()`).
    """

    def __init__(self, lengths: Sequence[int], tokens_per_global_batch: int, max_seq_length: int,
                 consumed_samples: int = 0, drop_last: bool = False):
        if max_seq_length <= 0:
            raise ValueError(f"--seq-length must be positive, got {max_seq_length}")
        if tokens_per_global_batch < max_seq_length:
            raise ValueError(f"--tokens-per-global-batch ({tokens_per_global_batch}) must be at least "
                             f"--seq-length ({max_seq_length}) so every sample fits in a batch")
        self.lengths = np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_length)
        if not 0 <= consumed_samples <= len(self.lengths):
            raise ValueError(f"consumed_samples {consumed_samples} outside [0, {len(self.lengths)}]")
        self.budget = tokens_per_global_batch
        self.max_seq_length = max_seq_length
        self.consumed_samples = consumed_samples
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        batch, used = [], 0
        for idx in range(self.consumed_samples, len(self.lengths)):
            n = int(self.lengths[idx])
            if batch and used + n > self.budget:
                self.consumed_samples += len(batch)
                yield batch
                batch, used = [], 0
            batch.append(idx)
            used += n
        if batch and not self.drop_last:
            self.consumed_samples += len(batch)
            yield batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
