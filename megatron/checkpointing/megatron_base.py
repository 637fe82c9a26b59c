"""What the Megatron-LM format modules share below them: the error they raise and the walk over
Megatron's nested model dicts (`megatron_legacy` reads files, `megatron_t5` maps T5's names,
`megatron_write` writes; this module imports none of them)."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch


class MegatronCheckpointError(ValueError):
    pass


def flatten(d: dict, prefix: str = "") -> Dict[str, torch.Tensor]:
    """A nested model dict as {dotted name: leaf}; None leaves (Megatron's empty extra state) dropped."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif v is not None:
            out[prefix + k] = v
    return out


def undo_layernorm_1p(args, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Megatron-LM run with --apply-layernorm-1p computes each norm as x * (1 + w) and stores w
    (zero at initialisation); this project computes x * w and stores w: add the 1 back to every
    norm's scale (not its bias), in the tensor's own dtype as Megatron's forward adds it. The
    Adam moments need nothing (the gradient with respect to w is the same)."""
    if not getattr(args, "apply_layernorm_1p", False):
        return full
    return {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in full.items()}


# ---- what Megatron's save_checkpoint stores beside the model (megatron_write, megatron_moe_write) ----
def megatron_rng_state() -> list:
    """Megatron's `rng_state`: one dict per data-parallel rank (only this one is kept, as
    Megatron does without --data-parallel-random-init)."""
    import random
    from megatron.core.tensor_parallel.random import get_rng_tracker
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state(),
             "rng_tracker_states": get_rng_tracker().get_states()}]


def megatron_scheduler(ours: Optional[dict], weight_decay: float = 0.01, gbs: int = 1) -> Optional[dict]:
    """This project's LR schedule state with Megatron's OptimizerParamScheduler keys (Megatron
    counts its steps in samples: iterations x `gbs`)."""
    if not ours:
        return None
    decay = ours.get("decay_iters", ours.get("decay_steps"))
    return {"max_lr": ours.get("max_lr"), "min_lr": ours.get("min_lr"),
            "lr_warmup_steps": ours.get("warmup_iters", ours.get("warmup_steps", 0)) * gbs,
            "lr_decay_steps": decay * gbs if decay is not None else None,
            "lr_decay_style": ours.get("decay_style", "linear"), "num_steps": ours.get("num_steps", 0) * gbs,
            "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_steps": (ours.get("decay_iters") or 1) * gbs,
            "wd_incr_style": "constant"}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary table padded to Megatron's padded size as transformers' GPT-2 -> Megatron
    converter pads it (copies of the last real row), or cut to it."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])])
