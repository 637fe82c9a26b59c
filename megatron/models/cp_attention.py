"""Self-attention over a sequence whose tokens are spread over a context-parallel group.

Each rank holds the queries, keys and values of its own tokens (two chunks, see
megatron/core/context_parallel.py). Attention needs every key and value of the sequence:

* ``all_gather`` (as Llama 3 training does): all-gather K and V over the CP group (backward:
  reduce-scatter of their gradients), then attend the local queries to all S keys with the mask
  "key index <= query index, same document". Simple and exact; holds S keys per layer.
* ``p2p`` (ring attention): N steps; at step j a rank attends to the K/V block of rank r-j and
  passes it on to rank r+1 (backward: the gradients travel the ring the other way). The
  softmax is merged online: a running maximum, denominator and weighted sum, rescaled as each
  block arrives, so no rank holds more than two K/V blocks at once in the forward. The
  backward is autograd's (it keeps each step's scores, as the all-gather path does); a fused
  flash-style kernel that recomputes them is the GPU follow-up.

Masks use absolute token indices, so packed rows' documents may begin or end anywhere in a
chunk; padding tokens (document 0) attend only to themselves, as in packed_attention_mask.
With dropout, the attention probabilities' masks are keyed by (batch row, global head,
query index, key index), so every CP size and both exchanges draw the mask of the CP 1 run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import all_token_index
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


@dataclass
class ContextParallelSpec:
    """What every attention layer of a stage needs to attend across the CP group; passed in
    place of the attention mask (like PackedSegments)."""
    group: Optional[object]
    size: int
    rank: int
    global_ranks: List[int]
    comm_type: str
    index: torch.Tensor                   # [l] absolute index of each local token
    all_index: torch.Tensor               # [S] every rank's indices, rank order
    segment_ids: Optional[torch.Tensor]   # [b, S] full rows' document ids (packed rows)
    dropout: Optional[object] = None      # KeyedDropout, when the model drops out

    @property
    def offset(self) -> torch.Tensor:  # token positions for keyed hidden dropout
        return self.index

    def token_positions(self, length: int, sp_rank: int) -> torch.Tensor:
        """Positions of a sequence-parallel rank's share of the local tokens."""
        return self.index[sp_rank * length:(sp_rank + 1) * length]

    def rank_index(self, r: int) -> torch.Tensor:
        n = self.index.numel()
        return self.all_index[r * n:(r + 1) * n]

    def mask(self, key_index: torch.Tensor) -> torch.Tensor:
        """bool [b|1, 1, l, len(key_index)]: True = the local query may attend to the key."""
        q, k = self.index, key_index
        causal = k[None, :] <= q[:, None]
        if self.segment_ids is None:
            return causal[None, None]
        qs, ks = self.segment_ids[:, q], self.segment_ids[:, k]
        same = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] > 0)
        pad_self = (qs == 0)[:, :, None] & (k[None, :] == q[:, None])[None]
        return ((same & causal) | pad_self).unsqueeze(1)


def build_cp_spec(comm_type: str, ps, batch: dict, device, training: bool) -> ContextParallelSpec:
    from megatron.models.sliced_attention import KeyedDropout
    index = batch["cp_index"].to(device)
    seq = index.numel() * ps.cp_size
    seg = batch.get("cp_segment_ids")
    salt = batch.get("cp_dropout_salt")
    dropout = KeyedDropout(int(salt)) if salt is not None and training else None
    return ContextParallelSpec(ps.cp_group, ps.cp_size, ps.cp_rank, list(ps.cp_global_ranks),
                               comm_type, index, all_token_index(seq, ps.cp_size).to(device),
                               None if seg is None else seg.to(device), dropout)


def cp_core_attention(q, k, v, spec: ContextParallelSpec, dropout_p: float, site: int, head0: int):
    """q, k, v: [l, b, np, hn] of the local tokens -> context [l, b, np * hn]."""
    if dropout_p > 0 and spec.dropout is None:
        raise RuntimeError("context parallelism draws attention dropout keyed by token position, but the "
                           "micro-batch carries no cp_dropout_salt (build it with ContextParallelSource)")
    if spec.comm_type == "p2p" and spec.size > 1:
        out = _ring_attention(q, k, v, spec, dropout_p, site, head0)
    else:
        out = _gathered_attention(q, k, v, spec, dropout_p, site, head0)
    b, np_, l, hn = out.shape
    return out.permute(2, 0, 1, 3).reshape(l, b, np_ * hn)


def _gathered_attention(q, k, v, spec, dropout_p, site, head0):
    if spec.size > 1:
        k = gather_from_sequence_parallel_region(k, spec.group)
        v = gather_from_sequence_parallel_region(v, spec.group)
    keys = spec.all_index
    mask = spec.mask(keys)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
    if dropout_p > 0:
        return spec.dropout.attention(q, k, v, mask, dropout_p, site, spec.index, head0, key_positions=keys)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _RingShift(torch.autograd.Function):
    """x from this rank -> the tensor of the previous CP rank (ring order); the backward sends
    each gradient back to the rank the tensor came from."""

    @staticmethod
    def forward(ctx, x, spec):
        ctx.spec = spec
        return _shift(x.contiguous(), spec, +1)

    @staticmethod
    def backward(ctx, g):
        return _shift(g.contiguous(), ctx.spec, -1), None


def _shift(x, spec, step: int):
    """Send x to the rank `step` places on in the ring, receive from `step` places back."""
    n, r, ranks = spec.size, spec.rank, spec.global_ranks
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, ranks[(r + step) % n], group=spec.group),
           dist.P2POp(dist.irecv, out, ranks[(r - step) % n], group=spec.group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def _ring_attention(q, k, v, spec, dropout_p, site, head0):
    q = q.permute(1, 2, 0, 3)  # [b, np, l, hn]
    b, np_, l, hn = q.shape
    scale = 1.0 / (hn ** 0.5)
    kv = torch.stack([k, v])  # one message per step
    acc = z = m_run = None
    for j in range(spec.size):
        if j:
            kv = _RingShift.apply(kv, spec)
        src = (spec.rank - j) % spec.size
        keys = spec.rank_index(src)
        kb, vb = (t.permute(1, 2, 0, 3) for t in (kv[0], kv[1]))
        s = (q @ kb.transpose(-1, -2)) * scale
        s = s.masked_fill(~spec.mask(keys), float("-inf"))
        # softmax is shift-invariant: the running maximum only keeps exp() in range, so it is
        # detached (its gradient is zero in exact arithmetic)
        m_blk = s.detach().amax(-1, keepdim=True)
        m_new = m_blk if m_run is None else torch.maximum(m_run, m_blk)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        e = torch.exp(s - m_safe)
        if dropout_p > 0:
            keep = spec.dropout.attention_keep(dropout_p, site, b, head0, np_, spec.index, keys, q.device)
            pv = (e * keep.to(e.dtype) / (1.0 - dropout_p)) @ vb
        else:
            pv = e @ vb
        if acc is None:
            acc, z = pv, e.sum(-1, keepdim=True)
        else:
            old = torch.exp(torch.where(torch.isinf(m_run), torch.zeros_like(m_run), m_run) - m_safe)
            old = torch.where(torch.isinf(m_run), torch.zeros_like(old), old)
            acc = acc * old + pv
            z = z * old + e.sum(-1, keepdim=True)
        m_run = m_new
    return acc / z
