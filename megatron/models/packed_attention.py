"""Attention over packed rows with the variable-length kernel instead of a dense mask.

A packed micro-batch [b, s] with `segment_ids` (1..k per sample, 0 on padding) becomes one
`PackedSegments` (cu_seqlens over the flattened b*s tokens), built once per stage forward and
handed to every layer in place of the dense [b, 1, s, s] mask. Attention then costs Σ lᵢ², and
gives what SDPA with `packed_attention_mask(segment_ids)` gives (padding tokens are length-1
segments that attend to themselves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.fused_kernels import ops


@dataclass(frozen=True)
class PackedSegments:
    cu_seqlens: torch.Tensor  # int64 [nseg + 1] over the flattened [b, s] tokens
    batch: int
    seq: int
    max_seqlen: Optional[int] = None  # longest segment, known on the host (torch's flash kernel needs it)


def host_segments(segment_ids: torch.Tensor) -> tuple:
    """(cu_seqlens, longest segment) of host segment ids, computed before the batch goes to a
    GPU so that no forward has to read them back from the device."""
    cu = ops.cu_seqlens_from_segment_ids(segment_ids)
    return cu, ops.max_seqlen(cu)


def packed_segments(cfg, segment_ids: Optional[torch.Tensor], device_tensor: torch.Tensor,
                    training: bool, cu_seqlens: Optional[torch.Tensor] = None,
                    max_seqlen: Optional[int] = None) -> Optional[PackedSegments]:
    """The varlen description of a packed batch, or None when the dense-mask path must run:
    no segment ids, --no-masked-softmax-fusion, or no kernel for this device (torch's flash
    varlen kernel counts on CUDA, but it has no dropout: training with attention dropout there
    needs the project's CUDA kernel). `cu_seqlens` / `max_seqlen` precomputed on the host
    (`host_segments`) are used as given."""
    if segment_ids is None or not getattr(cfg, "masked_softmax_fusion", False):
        return None
    if not ops.use_fused(device_tensor):
        dropout = training and getattr(cfg, "attention_dropout", 0.0) > 0
        if not (device_tensor.is_cuda and ops.torch_varlen_attn() is not None and not dropout):
            return None
    seg = torch.as_tensor(segment_ids)
    if cu_seqlens is None:
        cu_seqlens = ops.cu_seqlens_from_segment_ids(seg)
    return PackedSegments(cu_seqlens.to(device_tensor.device), seg.shape[0], seg.shape[1], max_seqlen)


def varlen_core_attention(q, k, v, packed: PackedSegments, causal: bool, dropout_p: float):
    """q, k, v: [s, b, np, hn] -> context [s, b, np * hn]."""
    s, b, np_, hn = q.shape
    if (s, b) != (packed.seq, packed.batch):
        raise ValueError(f"packed segments describe [{packed.batch}, {packed.seq}] rows, attention got [{b}, {s}]")
    flat = lambda t: t.transpose(0, 1).reshape(b * s, t.shape[2], t.shape[3])
    out = ops.varlen_attention(flat(q), flat(k), flat(v), packed.cu_seqlens, causal=causal,
                               dropout_p=dropout_p, max_seqlen_q=packed.max_seqlen)
    return out.view(b, s, np_ * hn).transpose(0, 1)
