"""Flash-style attention of a CP rank's queries to keys and values spread over its CP group.

Both exchanges are one `torch.autograd.Function` that keeps, per layer, what flash attention
keeps: the local q, k, v (as handed in: views of the QKV projection's output), the output and
the log-sum-exp of each query row (float32, or float64 for float64 inputs). Scores,
probabilities, masks and dropout keep-masks are recomputed block by block in the backward,
so a rank keeps ~1/CP of what one process keeps for the whole sequence.

* ``RingAttention`` (p2p): N steps; at step j a rank attends to the K/V block of rank r-j
  (received from rank r-1 while it attends to the block before), merging blocks with an
  online softmax (running maximum m and sum z, the partial output rescaled by exp(m_old -
  m_new)). The backward runs the ring again: K/V travel as in the forward, and with them an
  accumulator of that block's dK/dV to which every rank adds its share; a last shift brings
  each accumulator home. No gathered K/V is kept: the ring re-fetches the blocks.
* ``GatheredAttention`` (all_gather): all-gather K/V, attend block by block (same online
  softmax); the backward all-gathers K/V again and
  reduce-scatters dK/dV. Keeping the gathered K/V instead would save that second all-gather
  but hold CP x the local K/V per layer (0.625 of one process at CP 4, not ~1/CP): the
  memory is what CP is for, so K/V are gathered twice, as the ring sends them twice.

Block arithmetic: matmuls in the inputs' dtype; scores, softmax statistics and the output,
dQ, dK, dV accumulators in ``stat_dtype`` (float32 at least). With dropout (keyed by
absolute positions, megatron/models/sliced_attention.py) the statistics are those of the
undropped softmax, P·keep/(1-p) multiplies V, and the backward's row term D = rowsum(dO·O)
holds unchanged (as in FlashAttention).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import _gather_first, _reduce_scatter_first


# Queries and keys per score tile: a block's transient scores are [b, np, TILE, TILE] (each
# tile is merged into the online softmax like a block), not local queries x block keys.
TILE = 256


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bn(x):  # [l, b, np, hn] -> [b, np, l, hn] (a view)
    return x.permute(1, 2, 0, 3)


def _lb(x):  # [b, np, l, hn] -> [l, b, np, hn] (a view)
    return x.permute(2, 0, 1, 3)


class _Blocks:
    """Per-call constants: the spec (masks, dropout keys), scale, dropout and the head range."""

    def __init__(self, spec, q, p, site, head0):
        self.spec, self.p, self.site, self.head0 = spec, p, site, head0
        self.scale = 1.0 / (q.shape[-1] ** 0.5)
        self.sd = stat_dtype(q.dtype)

    def _scores(self, q, k, rows, keys):
        s = (q @ k.transpose(-1, -2)).to(self.sd) * self.scale
        return s.masked_fill(~self.spec.mask(keys, rows), float("-inf"))

    def _keep(self, q, rows, keys):
        if self.p <= 0:
            return None
        b, np_, _, _ = q.shape
        keep = self.spec.dropout.attention_keep(self.p, self.site, b, self.head0, np_, self.spec.index[rows], keys,
                                                q.device)
        return keep.to(self.sd) / (1.0 - self.p)

    def start(self, q):
        """Empty state: running maximum -inf, sum 0, output 0 ([b, np, l, 1 | hn], stat dtype)."""
        b, np_, l, hn = q.shape
        m = torch.full((b, np_, l, 1), float("-inf"), dtype=self.sd, device=q.device)
        return m, torch.zeros_like(m), torch.zeros((b, np_, l, hn), dtype=self.sd, device=q.device)

    def forward(self, q, k, v, keys, state):
        """Merge the block (k, v [b, np, lk, hn] at absolute positions `keys`) into `state`,
        TILE queries x TILE keys at a time (each tile merged like a block)."""
        m, z, acc = state
        for rows, cols in _tiles(q.shape[-2], k.shape[-2]):
            st = (m[..., rows, :], z[..., rows, :], acc[..., rows, :])
            m[..., rows, :], z[..., rows, :], acc[..., rows, :] = self._tile_forward(
                q[..., rows, :], k[..., cols, :], v[..., cols, :], rows, keys[cols], st)
        return state

    def _tile_forward(self, q, k, v, rows, keys, state):
        s = self._scores(q, k, rows, keys)
        m_old, z, acc = state
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        # rows with no visible key yet keep m = -inf; exponents are taken against 0 there
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        e = torch.exp(s - m_safe)
        z_blk = e.sum(-1, keepdim=True)
        keep = self._keep(q, rows, keys)
        if keep is not None:
            e = e * keep
        pv = (e.to(v.dtype) @ v).to(self.sd)
        alpha = torch.exp(m_old - m_safe)  # exp(-inf) = 0: nothing seen before (then z, acc are 0)
        return m_new, z * alpha + z_blk, acc * alpha + pv

    @staticmethod
    def finish(state, dtype):
        """-> output [b, np, l, hn] in `dtype`, log-sum-exp [b, np, l, 1] (every row sees its own key)."""
        m, z, acc = state
        return (acc / z).to(dtype), m + torch.log(z)

    def backward(self, q, k, v, keys, do, lse, d):
        """dq, dk, dv (stat dtype) of one block from the recomputed probabilities, by tiles."""
        dq = torch.zeros(q.shape, dtype=self.sd, device=q.device)
        dk = torch.zeros(k.shape, dtype=self.sd, device=q.device)
        dv = torch.zeros(v.shape, dtype=self.sd, device=q.device)
        for rows, cols in _tiles(q.shape[-2], k.shape[-2]):
            g = self._tile_backward(q[..., rows, :], k[..., cols, :], v[..., cols, :], rows, keys[cols],
                                    do[..., rows, :], lse[..., rows, :], d[..., rows, :])
            dq[..., rows, :] += g[0]
            dk[..., cols, :] += g[1]
            dv[..., cols, :] += g[2]
        return dq, dk, dv

    def _tile_backward(self, q, k, v, rows, keys, do, lse, d):
        p = torch.exp(self._scores(q, k, rows, keys) - lse)
        keep = self._keep(q, rows, keys)
        pd = p if keep is None else p * keep
        dv = pd.to(do.dtype).transpose(-1, -2) @ do
        dp = (do @ v.transpose(-1, -2)).to(self.sd)
        if keep is not None:
            dp = dp * keep
        ds = (p * (dp - d) * self.scale).to(q.dtype)
        return (ds @ k).to(self.sd), (ds.transpose(-1, -2) @ q).to(self.sd), dv.to(self.sd)


def _tiles(queries: int, keys: int):
    return [(slice(i, i + TILE), slice(j, j + TILE)) for i in range(0, queries, TILE) for j in range(0, keys, TILE)]


def _row_term(dout, out, sd):
    """D = rowsum(dO * O), [b, np, l, 1]."""
    return _bn((dout.to(sd) * out.to(sd)).sum(-1, keepdim=True))


def _start_shift(x, spec, step: int = 1):
    """Begin sending x to the rank `step` places on in the ring and receiving from `step` back."""
    n, r, ranks = spec.size, spec.rank, spec.global_ranks
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, ranks[(r + step) % n], group=spec.group),
           dist.P2POp(dist.irecv, out, ranks[(r - step) % n], group=spec.group)]
    return out, dist.batch_isend_irecv(ops)


def _finish_shift(pending):
    out, works = pending
    for w in works:
        w.wait()
    return out


class RingAttention(torch.autograd.Function):
    """q, k, v [l, b, np, hn] of the local tokens -> output [l, b, np, hn] (p2p exchange)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, p, site, head0):
        blk = _Blocks(spec, q, p, site, head0)
        qb, n = _bn(q), spec.size
        state = blk.start(qb)
        kv = torch.stack([k, v])  # one message per step
        for j in range(n):
            pending = _start_shift(kv, spec) if j < n - 1 else None  # the next block travels meanwhile
            keys = spec.rank_index((spec.rank - j) % n)
            state = blk.forward(qb, _bn(kv[0]), _bn(kv[1]), keys, state)
            if pending is not None:
                kv = _finish_shift(pending)
        out, lse = blk.finish(state, q.dtype)
        out = _lb(out).contiguous()  # [l, b, np, hn]: the caller's reshape is a view of what is kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blk = blk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blk, spec = ctx.blk, ctx.blk.spec
        n, sd = spec.size, blk.sd
        qb, do, d = _bn(q), _bn(dout), _row_term(dout, out, sd)
        dq = torch.zeros(qb.shape, dtype=sd, device=q.device)
        kv, sending = torch.stack([k, v]), None
        for j in range(n):
            keys = spec.rank_index((spec.rank - j) % n)
            pending = _start_shift(kv, spec) if j < n - 1 else None
            dq_j, dk_j, dv_j = blk.backward(qb, _bn(kv[0]), _bn(kv[1]), keys, do, lse, d)
            dq += dq_j
            dkv = torch.stack([_lb(dk_j), _lb(dv_j)])
            if sending is not None:  # this block's accumulator, from the previous rank
                dkv += _finish_shift(sending)
            sending = _start_shift(dkv, spec)  # travels while the next block is computed
            if pending is not None:
                kv = _finish_shift(pending)
        dkv = _finish_shift(sending)
        # after N shifts each accumulator is back on the rank whose block it is
        return _lb(dq).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class GatheredAttention(torch.autograd.Function):
    """q, k, v [l, b, np, hn] of the local tokens -> output [l, b, np, hn] (all_gather exchange)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, p, site, head0):
        blk = _Blocks(spec, q, p, site, head0)
        qb = _bn(q)
        state = blk.start(qb)
        kv = _gather_kv(k, v, spec)
        for src, sl in _rank_slices(spec, k.shape[0]):
            state = blk.forward(qb, _bn(kv[sl, ..., 0, :]), _bn(kv[sl, ..., 1, :]), spec.rank_index(src), state)
        del kv
        out, lse = blk.finish(state, q.dtype)
        out = _lb(out).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blk = blk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blk, spec = ctx.blk, ctx.blk.spec
        sd = blk.sd
        qb, do, d = _bn(q), _bn(dout), _row_term(dout, out, sd)
        kv = _gather_kv(k, v, spec)  # gathered again rather than kept (module docstring)
        dq = torch.zeros(qb.shape, dtype=sd, device=q.device)
        dkv = torch.empty(kv.shape, dtype=sd, device=q.device)
        for src, sl in _rank_slices(spec, k.shape[0]):
            dq_j, dk_j, dv_j = blk.backward(qb, _bn(kv[sl, ..., 0, :]), _bn(kv[sl, ..., 1, :]),
                                            spec.rank_index(src), do, lse, d)
            dq += dq_j
            dkv[sl, ..., 0, :] = _lb(dk_j)
            dkv[sl, ..., 1, :] = _lb(dv_j)
        del kv
        dkv = _reduce_scatter_first(dkv, spec.group) if spec.size > 1 else dkv
        return _lb(dq).to(q.dtype), dkv[..., 0, :].to(k.dtype), dkv[..., 1, :].to(v.dtype), None, None, None, None


def _gather_kv(k, v, spec):
    """[S, b, np, 2, hn]: every rank's K and V in rank order (one all-gather)."""
    kv = torch.stack([k, v], dim=3)
    return _gather_first(kv, spec.group) if spec.size > 1 else kv


def _rank_slices(spec, local: int):
    return [(r, slice(r * local, (r + 1) * local)) for r in range(spec.size)]
