"""Context parallelism: which tokens of a sequence each rank of a CP group holds, and the
micro-batches it runs.

Every rank of a CP group loads the same samples (it shares its DP rank) and keeps two chunks
of each sequence: cut the sequence into 2N equal chunks, rank r holds chunks r and 2N-1-r.
Under causal attention chunk i attends to i+1 chunks, so every rank gets the same amount of
attention work (2N+1 chunk pairs), which an even split into N chunks would not give.

A rank's micro-batch holds only its tokens (tokens, labels, loss mask, absolute position ids)
plus what attention needs to see the whole sequence: `cp_index` (the absolute token index of
each local token, equal for every row) and, for packed rows, `cp_segment_ids` (the full rows'
document ids, so a document may start or end anywhere in a chunk). Loss sums and token counts
are per rank and add up over DP x CP (`ParallelState.grad_group`), like the gradients.

Dropout masks under CP are keyed by absolute token position (megatron/models/sliced_attention.py
KeyedDropout, as TeraPipe's token slices), so any CP size draws the same masks;
`cp_dropout_salt` carries the (seed, iteration, micro-batch) key.

CP size per micro-batch (`--dynapipe-cp-sizes`): the plan gives each micro-batch a size c
(dividing the CP size N) and this rank's index in the sub-group of c consecutive CP indices that
runs it (ParallelState.cp_subgroups). The source then cuts the row into 2c chunks (`cp_size`
rides along for the attention's group); at c = 1 the micro-batch runs whole on this rank, as
without CP. Loss sums still add up over DP x CP, so any split of the batch over ranks is exact.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# [b, s] fields of a GPT micro-batch that are cut along the sequence
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def chunk_token_index(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Absolute indices of the tokens CP rank `cp_rank` holds: chunks r and 2N-1-r of 2N."""
    n = 2 * cp_size
    if seq_len % n:
        raise ValueError(f"--context-parallel-size {cp_size}: a sequence of {seq_len} tokens does not cut into "
                         f"2 x CP = {n} equal chunks")
    c = seq_len // n
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((n - 1 - cp_rank) * c, (n - cp_rank) * c)])


def all_token_index(seq_len: int, cp_size: int) -> torch.Tensor:
    """Every rank's indices, in rank order: the order of an all-gather over the CP group."""
    return torch.cat([chunk_token_index(seq_len, cp_size, r) for r in range(cp_size)])


def pad_microbatch(mb: dict, granule: int) -> dict:
    """Pad [b, s] rows at the end to a multiple of `granule` tokens. Padding is causally after
    every real token and has loss mask 0 (and document id 0 in packed rows, attending only to
    itself), so no real token's loss or gradient changes."""
    s = mb["tokens"].shape[1]
    extra = -s % granule
    if not extra:
        return mb
    out = dict(mb)
    for key in SEQUENCE_KEYS + ("segment_ids",):
        v = mb.get(key)
        if not torch.is_tensor(v):
            continue
        if key == "position_ids":  # repeat the last position: stays inside the position table
            fill = v[:, -1:].expand(v.shape[0], extra)
        else:
            fill = torch.zeros(v.shape[0], extra, dtype=v.dtype, device=v.device)
        out[key] = torch.cat([v, fill], dim=1)
    return out


def split_microbatch(mb: dict, cp_size: int, cp_rank: int, salt: Optional[int] = None) -> dict:
    """This CP rank's part of a GPT micro-batch (see the module docstring)."""
    tokens = mb["tokens"]
    b, s = tokens.shape
    idx = chunk_token_index(s, cp_size, cp_rank).to(tokens.device)
    out = {k: v for k, v in mb.items() if k not in ("segment_ids", "cu_seqlens", "max_seqlen")}
    if "position_ids" not in mb:
        out["position_ids"] = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    for key in SEQUENCE_KEYS:
        v = out.get(key)
        if torch.is_tensor(v):
            out[key] = v.index_select(1, idx.to(v.device))
    if torch.is_tensor(mb.get("segment_ids")):
        out["cp_segment_ids"] = mb["segment_ids"]
    if "num_real_tokens" in mb:  # counted once per sample: CP rank 0 reports it
        out["num_real_tokens"] = mb["num_real_tokens"] if cp_rank == 0 else 0
    out["cp_index"] = idx
    out["cp_size"] = cp_size
    if salt is not None:
        out["cp_dropout_salt"] = torch.tensor(int(salt), dtype=torch.int64)
    return out


def local_shapes_fn(shapes_fn: Callable, cp_size: int, granule: int) -> Callable:
    """LoadInput shapes of a micro-batch as a CP rank runs it: ((b, padded s / CP),)."""
    def shapes(mb):
        (b, s), *rest = shapes_fn(mb)
        s += -s % granule
        return ((b, s // cp_size), *rest)
    return shapes


def dropout_salt(seed: int, iteration: int, dp_rank: int, microbatch: int) -> int:
    """Key of one micro-batch's dropout masks: the same on every CP rank and at every CP size."""
    return (seed * 1_000_003 + iteration * 10_007 + dp_rank * 7_919 + microbatch) % (1 << 31)


class ContextParallelSource:
    """Wraps a batch source (fixed or multi-task micro-batches): the same samples on every CP
    rank of a DP rank, each rank keeping its chunks. Plans must be made for the local shapes
    (`local_shapes_fn`), which is how build_gpt_trainer builds the inner source."""

    def __init__(self, inner, cfg, ps):
        self.inner, self.cfg, self.ps = inner, cfg, ps
        p = cfg.parallel
        tp = ps.tp_size if cfg.model.sequence_parallel else 1
        self.granule = 2 * p.context_parallel_size * tp
        m = cfg.model
        self.keyed = m.hidden_dropout > 0 or m.attention_dropout > 0

    def next(self, iteration: int, consumed_samples: int):
        work = self.inner.next(iteration, consumed_samples)
        ps, seed = self.ps, self.cfg.training.seed
        out = []
        for i, mb in enumerate(work.microbatches):
            mb = pad_microbatch(mb, self.granule)
            planned = mb.pop("cp_split", None)  # the plan's CP size and sub-group index (variable CP)
            size, rank = planned if planned is not None else (ps.cp_size, ps.cp_rank)
            # Planned at 1: the whole micro-batch on this rank, no exchange. (CP 1 without a plan
            # is --cp-keyed-dropout's path: it must still cut and key its masks.)
            if planned is not None and size == 1:
                out.append(mb)
                continue
            out.append(split_microbatch(mb, size, rank, dropout_salt(seed, iteration, ps.dp_rank, i)
                                        if self.keyed else None))
        work.microbatches = out
        return work

    def __getattr__(self, name):  # close(), valid_source, ... of the wrapped source
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
