"""What the Megatron-LM format modules share below them: the error they raise and the walk over
Megatron's nested model dicts (`megatron_legacy` reads files, `megatron_t5` maps T5's names,
`megatron_write` writes; this module imports none of them)."""
from __future__ import annotations

from typing import Dict

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
