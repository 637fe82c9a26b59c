"""Self-attention over a sequence whose tokens are spread over a context-parallel group.

Each rank holds the queries, keys and values of its own tokens (two chunks, see
megatron/core/context_parallel.py). Attention needs every key and value of the sequence:

* ``all_gather`` (as Llama 3 training does): all-gather K and V over the CP group (backward:
  gathered again, then reduce-scatter of their gradients) and attend the local queries to all
  S keys with the mask "key index <= query index, same document".
* ``p2p`` (ring attention): N steps; at step j a rank attends to the K/V block of rank r-j while
  it passes the block on to rank r+1; the backward runs the ring again with dK/dV accumulators.

Both are flash-style (megatron/models/cp_flash.py): online softmax over blocks, keeping only
q, k, v, the output and the log-sum-exp; scores and masks are recomputed in the backward, so a
rank keeps ~1/CP of one process's attention memory (docs/context_parallel.md).

Masks use absolute token indices, so packed rows' documents may begin or end anywhere in a
chunk; padding tokens (document 0) attend only to themselves, as in packed_attention_mask.
With dropout, the attention probabilities' masks are keyed by (batch row, global head,
query index, key index), so every CP size and both exchanges draw the mask of the CP 1 run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron.core.context_parallel import all_token_index
from megatron.models.cp_flash import GatheredAttention, RingAttention


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

    def mask(self, key_index: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """bool [b|1, 1, l, len(key_index)]: True = the local query (of `rows`) may attend to the key."""
        q, k = self.index[rows], key_index
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
    size = int(batch.get("cp_size", ps.cp_size))
    group, ranks, rank = ps.cp_group, list(ps.cp_global_ranks), ps.cp_rank
    if size != ps.cp_size:  # a micro-batch planned at a smaller CP size: its nested sub-group
        group, ranks = ps.cp_subgroups[size]
        rank = ranks.index(ps.rank)
    seq = index.numel() * size
    seg = batch.get("cp_segment_ids")
    salt = batch.get("cp_dropout_salt")
    dropout = KeyedDropout(int(salt)) if salt is not None and training else None
    return ContextParallelSpec(group, size, rank, ranks,
                               comm_type, index, all_token_index(seq, size).to(device),
                               None if seg is None else seg.to(device), dropout)


def cp_core_attention(q, k, v, spec: ContextParallelSpec, dropout_p: float, site: int, head0: int):
    """q, k, v: [l, b, np, hn] of the local tokens -> context [l, b, np * hn]."""
    if dropout_p > 0 and spec.dropout is None:
        raise RuntimeError("context parallelism draws attention dropout keyed by token position, but the "
                           "micro-batch carries no cp_dropout_salt (build it with ContextParallelSource)")
    fn = RingAttention if spec.comm_type == "p2p" and spec.size > 1 else GatheredAttention
    out = fn.apply(q, k, v, spec, float(dropout_p), site, head0)
    l, b, np_, hn = out.shape
    return out.view(l, b, np_ * hn)
