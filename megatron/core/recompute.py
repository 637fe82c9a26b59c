"""The recompute set of a transformer layer: one definition for the model, Aceso's runtime and
its cost model (so a configuration runs exactly as it was priced).

A layer runs as a fixed sequence of named operators (``LAYER_OPS``, the rows our Aceso
profiler writes). A recompute set names the operators whose saved activations are dropped after
the forward pass and rebuilt during the backward pass. Contiguous flagged operators form one
*run*: the runtime checkpoints each run as one segment that keeps only its inputs, and the cost
model charges exactly that (``contiguous_runs`` is the segmentation both use).

Per-layer settings are strings: ``none``, ``selective`` (core attention), ``full`` (every
operator: the whole layer is one run) or operator names joined by ``+`` in layer order, e.g.
``enc-MLP-GEMM-1+enc-MLP-gelu``. Pure Python (no torch): ``megatron.config.core`` validates with it.
"""
from __future__ import annotations

from typing import FrozenSet, Iterable, List, Optional, Sequence, Tuple

# The operators of one (GPT / T5 encoder) layer in the order the layer runs them.
LAYER_OPS: Tuple[str, ...] = (
    "enc-1st-layernorm", "enc-attention-qkv", "enc-attention-core", "enc-attention-dense",
    "enc-post-attention-dropout", "enc-2nd-layernorm", "enc-MLP-GEMM-1", "enc-MLP-gelu",
    "enc-MLP-GEMM-2", "enc-post-MLP-dropout",
)
CORE_ATTENTION = "enc-attention-core"
MLP_OPS: Tuple[str, ...] = ("enc-MLP-GEMM-1", "enc-MLP-gelu", "enc-MLP-GEMM-2")

# Aceso's published CUDA tables split core attention into four operators; our layer runs them as
# one fused kernel (scaled_dot_product_attention), which can only be recomputed as a whole.
ACESO_LAYER_OPS: Tuple[str, ...] = (
    "enc-1st-layernorm", "enc-attention-qkv", "enc-attention-score", "enc-attention-softmax",
    "enc-attention-dropout", "enc-attention-context", "enc-attention-dense",
    "enc-post-attention-dropout", "enc-2nd-layernorm", "enc-MLP-GEMM-1", "enc-MLP-gelu",
    "enc-MLP-GEMM-2", "enc-post-MLP-dropout",
)
_ACESO_CORE = frozenset({"enc-attention-score", "enc-attention-softmax", "enc-attention-dropout",
                         "enc-attention-context"})

# A residual add reads the residual stream, which is the input of the layernorm before it. A
# checkpoint segment holding the add takes the residual as a second input; if that layernorm is
# recomputed inside an earlier segment (not at its start), nothing else keeps the residual.
RESIDUAL_OF = {"enc-post-attention-dropout": "enc-1st-layernorm",
               "enc-post-MLP-dropout": "enc-2nd-layernorm"}

NAMED = {
    "none": frozenset(),
    "selective": frozenset({CORE_ATTENTION}),
    "full": frozenset(LAYER_OPS),
}


def contiguous_runs(flags: Sequence[int], group: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """[start, end) index ranges of consecutive set flags; a run also ends where ``group``
    (e.g. the layer of each op) changes, since a checkpoint segment never spans two layers."""
    runs: List[Tuple[int, int]] = []
    start = None
    for i, f in enumerate(flags):
        if start is not None and (not f or (group is not None and group[i] != group[i - 1])):
            runs.append((start, i))
            start = None
        if f and start is None:
            start = i
    if start is not None:
        runs.append((start, len(flags)))
    return runs


def residual_inputs_kept(names: Sequence[str], flags: Sequence[int],
                         group: Optional[Sequence[int]] = None) -> List[int]:
    """Indices of layernorm ops whose input (the residual) some segment keeps beyond its own
    input: the segment holds a residual add, starts after that add's layernorm, and the
    layernorm is recomputed mid-segment (neither saving its input nor starting a segment)."""
    runs = contiguous_runs(flags, group)
    starts = {lo for lo, _ in runs}
    out = []
    for lo, hi in runs:
        for k in range(lo, hi):
            ln_name = RESIDUAL_OF.get(names[k])
            if ln_name is None:
                continue
            j = k - 1
            while j >= 0 and names[j] != ln_name and (group is None or group[j] == group[k]):
                j -= 1
            if j >= 0 and names[j] == ln_name and (group is None or group[j] == group[k]) \
                    and j < lo and flags[j] and j not in starts:
                out.append(j)
    return out


def from_flags(names: Sequence[str], flags: Iterable[int]) -> FrozenSet[str]:
    """The recompute set of one layer from per-operator 0/1 flags over ``names`` (our table's
    operators, or Aceso's 13: any of its four core-attention operators flags our fused one)."""
    out = set()
    for n, f in zip(names, flags):
        if not f:
            continue
        if n in _ACESO_CORE:
            n = CORE_ATTENTION
        if n not in LAYER_OPS:
            raise ValueError(f"operator {n!r} is not one of the layer's operators ({', '.join(LAYER_OPS)})")
        out.add(n)
    return frozenset(out)


def encode(ops: Iterable[str]) -> str:
    """Canonical per-layer setting: a named mode where one matches, else names joined by '+'."""
    s = frozenset(ops)
    for name, members in NAMED.items():
        if s == members:
            return name
    return "+".join(n for n in LAYER_OPS if n in s)


def decode(setting: str) -> FrozenSet[str]:
    """The operator set of a per-layer setting; ValueError names an unknown operator."""
    if setting in NAMED:
        return NAMED[setting]
    ops = frozenset(setting.split("+"))
    bad = sorted(ops - set(LAYER_OPS))
    if bad:
        raise ValueError(f"recompute setting {setting!r}: unknown operator(s) {', '.join(bad)}; use none, "
                         f"selective, full or '+'-joined names of {', '.join(LAYER_OPS)}")
    return ops


def layer_flags(ops: Iterable[str]) -> Tuple[int, ...]:
    s = frozenset(ops)
    return tuple(int(n in s) for n in LAYER_OPS)
