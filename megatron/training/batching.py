"""Turn GPT pretraining samples into the micro-batch dicts the executor loads."""
from __future__ import annotations

from typing import Sequence

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


def pad_rows(mb: dict, multiple: int) -> dict:
    """`mb` with rows appended until its row count is a multiple of `multiple`: copies of row 0
    with loss_mask 0, so they add no loss and exactly zero gradient (a copy of a real row keeps
    every attention row finite, which an all-padding packed row would not)."""
    b = int(mb["loss_mask"].shape[0])
    extra = -b % multiple
    if not extra:
        return mb
    out = {}
    for k, v in mb.items():
        if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == b:
            fill = v[:1].expand((extra,) + tuple(v.shape[1:]))
            out[k] = torch.cat([v, torch.zeros_like(fill) if k == "loss_mask" else fill])
        else:
            out[k] = v
    return out


def rows_of(mb: dict, index: int, parts: int) -> dict:
    """Part `index` of `parts` equal row blocks of a whole micro-batch (a stage's DP share when
    stages have their own DP sizes). `num_real_tokens` (a count for the log) stays with part 0."""
    b = int(mb["loss_mask"].shape[0])
    n = b // parts
    out = {}
    for k, v in mb.items():
        if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == b:
            out[k] = v[index * n:(index + 1) * n].contiguous()
        elif k == "num_real_tokens":
            out[k] = v if index == 0 else 0
        else:
            out[k] = v
    return out
