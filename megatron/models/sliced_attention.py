"""Keys/values of earlier token slices (TeraPipe): what lets a causal model run a sequence
slice by slice and still compute exactly the unsliced result.

One `SequenceKVCache` lives on a rank per (sequence, pipeline stage) for as long as the
executor runs slices of that sequence there. Every attention layer of the stage, when
running slice j (tokens [c, c+l)), calls `extend(layer, k, v)`:

* it attends over ``cat(K_<j, k_j)`` with the mask "query t may see key u iff u <= c + t"
  (the causal mask shifted by c); packed rows pass the rows [c, c+l) of their per-document
  mask over the prefix instead (same document and u <= c + t);
* ``K_<j`` is a fresh leaf built from the *detached* keys/values of slices 0..j-1, so every
  slice has its own autograd graph (TeraPipe detaches the incoming cache the same way);
* the slice's own k, v (still attached to its graph) become extra outputs of the slice.

Backward walks the slices of a sequence in reverse. After slice j's backward the gradient
that reached the leaf ``K_<j`` is split by slice and added to the accumulators of slices
0..j-1; when slice i's backward runs, its accumulated dk_i, dv_i are the gradients of its
extra outputs. All keys/values are per TP shard (local heads) because each rank caches only
what its own attention computed.

Memory: the cache holds the detached K/V of every slice run so far (the unsliced run holds
the same tensors as saved activations); each in-flight slice additionally saves its
concatenated ``(c + l)``-row K/V for its backward. `megatron.planner.terapipe.lowering` counts both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch


@dataclass
class SliceRecord:
    """What the executor keeps from a slice's forward until its backward."""
    index: int
    offset: int
    length: int
    leaves: List[tuple] = field(default_factory=list)   # (layer, k_prev leaf, v_prev leaf)
    outputs: List[tuple] = field(default_factory=list)  # (layer, k, v) attached to the graph


class SequenceKVCache:
    def __init__(self, sequence: int, stage: int, dropout_salt: Optional[int] = None):
        self.sequence, self.stage = sequence, stage
        # slice-keyed dropout (None: the model's ordinary dropout, used only with rate 0)
        self.dropout = KeyedDropout(dropout_salt) if dropout_salt is not None else None
        self.offsets: List[int] = []
        self.lengths: List[int] = []
        self.kv: Dict[int, List[tuple]] = {}        # layer -> per slice (k, v) detached
        self.grads: Dict[int, List[list]] = {}      # layer -> per slice [dk, dv] (or None)
        self.current: Optional[SliceRecord] = None
        self.backward_next: Optional[int] = None    # index of the slice whose backward is due
        self.replaying: Optional[SliceRecord] = None  # the slice whose backward runs (recompute replays it)

    @property
    def offset(self) -> int:  # of the slice running forward, or being replayed by recompute
        return (self.current or self.replaying).offset

    @property
    def filled(self) -> int:
        return self.offsets[-1] + self.lengths[-1] if self.offsets else 0

    def begin(self, offset: int, length: int) -> "SequenceKVCache":
        if offset != self.filled:
            raise RuntimeError(f"sequence {self.sequence}, stage {self.stage}: slice at token {offset} "
                               f"runs before tokens [{self.filled}, {offset}); slices of a sequence must be "
                               f"forwarded in order")
        self.current = SliceRecord(len(self.offsets), offset, length)
        return self

    def end(self) -> SliceRecord:
        rec, self.current = self.current, None
        self.offsets.append(rec.offset)
        self.lengths.append(rec.length)
        return rec

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]):
        """k, v: [l, b, heads, hn] of the current slice. Returns (K, V, mask) to attend with."""
        if self.current is None and self.replaying is not None:
            return self._replay(layer, k, v, mask)
        rec = self.current
        c, l = rec.offset, rec.length
        prev = self.kv.setdefault(layer, [])
        if len(prev) != rec.index:
            raise RuntimeError(f"sequence {self.sequence}, stage {self.stage}, layer {layer}: the "
                               f"cache holds {len(prev)} slices, expected {rec.index}")
        prev.append((k.detach(), v.detach()))
        self.grads.setdefault(layer, []).append([None, None])
        rec.outputs.append((layer, k, v))
        if mask is not None and tuple(mask.shape[-2:]) != (l, c + l):
            raise ValueError(f"a token slice of {l} tokens at {c} attends with a [{l}, {c + l}] mask "
                             f"(queries x prefix keys), got {list(mask.shape)}")
        if rec.index == 0:
            return k, v, mask  # the first slice: plain causal attention, or the packed rows' mask
        grad = torch.is_grad_enabled()
        k_prev = torch.cat([p[0] for p in prev[:-1]]).requires_grad_(grad)
        v_prev = torch.cat([p[1] for p in prev[:-1]]).requires_grad_(grad)
        if grad:
            rec.leaves.append((layer, k_prev, v_prev))
        if mask is None:  # causal, shifted by the slice's offset
            mask = torch.ones(l, c + l, dtype=torch.bool, device=k.device).tril(c).view(1, 1, l, c + l)
        return torch.cat([k_prev, k]), torch.cat([v_prev, v]), mask

    def _replay(self, layer: int, k, v, mask):
        """--recompute-granularity full: the backward of slice j re-runs its checkpointed layers.
        The replay only regenerates the values the original graph saved, so it attends over the
        same cached keys/values (slices 0..j-1 are still cached while j's backward runs) and
        writes nothing: the gradients still flow through the first forward's graph, into its
        leaves K_<j and its outputs k_j, v_j - one tensor each."""
        rec = self.replaying
        c, l = rec.offset, rec.length
        if rec.index == 0:
            return k, v, mask
        prev = self.kv[layer][:rec.index]
        if mask is None:
            mask = torch.ones(l, c + l, dtype=torch.bool, device=k.device).tril(c).view(1, 1, l, c + l)
        return (torch.cat([p[0] for p in prev] + [k]), torch.cat([p[1] for p in prev] + [v]), mask)

    # -- backward --------------------------------------------------------------------------
    def output_grads(self, rec: SliceRecord) -> tuple:
        """(tensors, grads) for the slice's extra outputs; grads of the last slice are None."""
        if self.backward_next is None:
            self.backward_next = len(self.offsets) - 1
        if rec.index != self.backward_next:
            raise RuntimeError(f"sequence {self.sequence}, stage {self.stage}: backward of slice {rec.index} "
                               f"(token {rec.offset}) while slice {self.backward_next} is due; slices of a "
                               f"sequence must run backward in reverse order")
        self.replaying = rec  # a checkpointed layer's replay during this backward reads the cache
        tensors, grads = [], []
        for layer, k, v in rec.outputs:
            dk, dv = self.grads[layer][rec.index]
            tensors += [k, v]
            grads += [dk, dv]
        return tensors, grads

    def accumulate(self, rec: SliceRecord) -> None:
        """After the slice's backward: hand the gradient w.r.t. earlier keys/values back."""
        bounds = self.lengths[:rec.index]
        for layer, k_prev, v_prev in rec.leaves:
            acc = self.grads[layer]
            for which, leaf in ((0, k_prev), (1, v_prev)):
                if leaf.grad is None:
                    continue
                for i, g in enumerate(leaf.grad.split(bounds)):
                    acc[i][which] = g if acc[i][which] is None else acc[i][which] + g
        for layer in self.grads:  # this slice's accumulators are consumed
            self.grads[layer][rec.index] = [None, None]
            self.kv[layer][rec.index] = None
        self.backward_next = rec.index - 1
        self.replaying = None

    @property
    def finished(self) -> bool:
        return self.backward_next == -1


# ------------------------------------------------------------------------ slice-keyed dropout
# With token slices, dropout masks must not depend on how the sequence was cut. Each mask
# element is a hash of (salt, site, absolute token position, batch row, channel or
# global head and key position), so every slicing - including a single slice, the unsliced
# computation - draws the same masks. Values stay below 2**31 so int64 products never overflow.
_M31 = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x * 1103515245 + 12345) & _M31
    x = x ^ (x >> 13)
    x = (x * 69069 + 907633385) & _M31
    x = x ^ (x >> 16)
    x = (x * 1103515245 + 12345) & _M31
    return x ^ (x >> 15)


def _combine(h: torch.Tensor, v) -> torch.Tensor:
    return _mix(h ^ (torch.as_tensor(v, dtype=torch.int64, device=h.device) & _M31))


def keep_mask(salt: int, site: int, dims: list, p: float, device) -> torch.Tensor:
    """Boolean keep-mask of shape [len(d) for d in dims]; dims[i] are the int64 coordinates
    (absolute positions, rows, channels) along axis i."""
    h = _mix(torch.tensor((salt * 7919 + site) & _M31, dtype=torch.int64, device=device))
    n = len(dims)
    for i, d in enumerate(dims):
        shape = [1] * n
        shape[i] = -1
        h = _combine(h, torch.as_tensor(d, dtype=torch.int64, device=device).view(shape))
    return h.to(torch.float64) / float(1 << 31) >= p


class KeyedDropout:
    """Dropout for one slice of one sequence: `salt` identifies (seed, iteration, sequence)."""

    def __init__(self, salt: int):
        self.salt = int(salt) & _M31

    def hidden(self, x: torch.Tensor, p: float, site: int, offset) -> torch.Tensor:
        """x [l, b, h] holding tokens [offset, offset + l), or the tokens at positions `offset`
        (an index tensor: a context-parallel rank's two chunks)."""
        l, b, h = x.shape
        dev = x.device
        keep = keep_mask(self.salt, site, [_positions(offset, l, dev), torch.arange(b, device=dev),
                                           torch.arange(h, device=dev)], p, dev)
        return x * keep.to(x.dtype) / (1.0 - p)

    def attention_keep(self, p: float, site: int, b: int, head0: int, np_: int, query_positions, key_positions,
                       device) -> torch.Tensor:
        """Keep-mask [b, np, len(query_positions), len(key_positions)] of attention probabilities."""
        return keep_mask(self.salt, site, [torch.arange(b, device=device),
                                           torch.arange(head0, head0 + np_, device=device),
                                           query_positions, key_positions], p, device)

    def attention(self, q, k, v, mask, p: float, site: int, offset, head0: int, key_positions=None) -> torch.Tensor:
        """q [b, np, l, hn] (queries at tokens offset..), k/v [b, np, c+l, hn] (tokens 0..),
        bool mask [.., l, c+l] or None (plain causal). Softmax attention with keyed dropout of
        the probabilities; heads are numbered globally (head0 = first local head)."""
        b, np_, l, hn = q.shape
        sk = k.shape[-2]
        dev = q.device
        scores = (q @ k.transpose(-1, -2)) / (hn ** 0.5)
        if mask is None:
            mask = torch.ones(l, sk, dtype=torch.bool, device=dev).tril(sk - l)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        keys = torch.arange(sk, device=dev) if key_positions is None else key_positions
        keep = self.attention_keep(p, site, b, head0, np_, _positions(offset, l, dev), keys, dev)
        return (probs * keep.to(probs.dtype) / (1.0 - p)) @ v


def _positions(offset, length: int, device) -> torch.Tensor:
    """Absolute token positions: [offset, offset + length), or `offset` itself if a tensor."""
    if torch.is_tensor(offset):
        return offset.to(device)
    return torch.arange(offset, offset + length, device=device)
