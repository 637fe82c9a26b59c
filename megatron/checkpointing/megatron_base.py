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
