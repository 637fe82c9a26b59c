"""Turn dataset samples into the micro-batch dicts the executor loads.

Fixed-size batching follows Megatron's pretraining sampler: the global batch of an iteration
is samples [consumed, consumed + global_batch); micro-batch k of data-parallel rank d holds
samples consumed + k*mbs*dp + d*mbs + [0, mbs). Every layout therefore trains on the same
samples, split differently.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch


def gpt_microbatch(samples: Sequence[dict], eod_token: int | None = None,
                   eod_mask_loss: bool = False) -> dict:
    """Samples with 'text' of length seq+1 -> tokens/labels/loss_mask [b, seq]."""
    text = torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss and eod_token is not None:
        loss_mask[tokens == eod_token] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def fixed_microbatch_indices(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                             dp_rank: int, dp_size: int) -> List[List[int]]:
    n_micro = global_batch_size // (micro_batch_size * dp_size)
    out = []
    for k in range(n_micro):
        base = consumed_samples + k * micro_batch_size * dp_size + dp_rank * micro_batch_size
        out.append(list(range(base, base + micro_batch_size)))
    return out
