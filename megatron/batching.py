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
