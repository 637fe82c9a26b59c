"""PowerSGD for the data-parallel gradient reduction (Optimus-CC's DP compression).

Why not `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`: it could run here (it only
calls buffer()/gradients()/index()/is_last() on its bucket, so a small Python stand-in for DDP's
C++ `GradBucket` drives it without DDP), but its semantics do not fit this trainer:
  * it averages over DP (divides P, Q and the uncompressed tensors by the world size), while our
    gradients are summed (the loss is normalised by the global token count), so its error and Q
    memories would carry a 1/DP factor;
  * it keys its error and Q memories by bucket index; ours are keyed by parameter, so checkpoints
    resume bit-exactly whatever the bucketing;
  * it orthogonalises with Gram-Schmidt at low rank or in half precision; we always use QR, which
    stays orthonormal when P is rank-deficient (tested).
The algorithm is the same: per matrix, P = M Q summed over DP, P orthonormalised, Q = M^T P
summed over DP, gradient := P Q^T; vectors (biases, norms) are all-reduced uncompressed.

Gradients in this trainer are *summed* over DP (the loss is normalised by the global token
count), so the reduced factors are sums and no division by the DP size happens. With error
feedback each rank keeps e_k = M_k - (P Q^T) / DP: the residuals of all ranks add up to
exactly what the compressed sum missed.
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.compression import lowrank
from megatron.compression.stats import Timer
from megatron.core.distributed import _bucketed_all_reduce


def matrix_view(g: torch.Tensor) -> torch.Tensor:
    return g.reshape(g.shape[0], -1)


REDUCERS = ("PowerSGD", "RandomizedSVD")


class PowerSGDReducer:
    """Rank-r reducer over one process group: PowerSGD (warm-started Q, one power step) or,
    with method="RandomizedSVD", a randomized range finder (Halko et al.): a fresh Gaussian
    sketch of width r + oversample each step, the same on every rank, Y = sum_k M_k Omega,
    P = orth(Y), B = sum_k P^T M_k, then the rank-r truncation of P B by an SVD of the small B
    (local, no extra traffic). rSVD keeps no warm-start state, so every step's approximation is
    independent of the last: more accurate on a single matrix, no convergence over steps.

    Used for the data-parallel reduction and, over the tied-embedding group, for
    --emb-grad-comp (`kind` names the message kind in --log-compression-stats)."""

    def __init__(self, rank: int, error_feedback: bool, warmup_iters: int, compress: bool, dp_group,
                 dp_size: int, seed: int = 0, method: str = "PowerSGD", oversample: int = 4,
                 kind: str = "dp", stage: int = 0):
        if method not in REDUCERS:
            raise ValueError(f"unknown low-rank reducer {method!r}; choose from {', '.join(REDUCERS)}")
        self.rank = rank
        self.error_feedback = error_feedback
        self.warmup_iters = warmup_iters
        self.compress = compress  # False on stages that --selective-grad-comp leaves uncompressed
        self.dp_group, self.dp_size = dp_group, dp_size
        self.method, self.oversample = method, oversample
        self.kind, self.stage = kind, stage
        self.state = lowrank.LowRankState(seed)
        self.stats = None  # a CompressionStats with --log-compression-stats

    @classmethod
    def from_config(cls, cfg, ps) -> "PowerSGDReducer":
        c = cfg.compression
        compress = not c.selective_grad_comp or ps.pp_rank < c.selective_grad_comp_way
        warmup = math.ceil(cfg.training.train_iters * c.grad_comp_warm_up)
        return cls(c.grad_comp_rank, c.use_error_feedback, warmup, compress, ps.dp_group, ps.dp_size,
                   seed=cfg.training.seed, method=getattr(c, "grad_comp_type", "PowerSGD"), stage=ps.pp_rank)

    def active(self, iteration: int) -> bool:
        return self.compress and iteration > self.warmup_iters

    def _width(self, rows: int, cols: int) -> int:
        extra = self.oversample if self.method == "RandomizedSVD" else 0
        return lowrank.effective_rank(rows, cols, self.rank + extra)

    def _compressible(self, rows: int, cols: int) -> bool:
        return lowrank.worth_compressing(rows, cols, self._width(rows, cols))

    def reduce(self, params: Sequence[nn.Parameter], iteration: int) -> Tuple[int, int]:
        """Sum the gradients of `params` over the group in place; returns (bytes sent, bytes
        an uncompressed all-reduce would have sent), per rank."""
        grads = []
        for p in params:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        return self.reduce_grads(grads, iteration)

    def reduce_grads(self, grads: List[torch.Tensor], iteration: int) -> Tuple[int, int]:
        """`reduce` on gradient tensors (summed in place; their order keys the state)."""
        raw = sum(g.numel() * g.element_size() for g in grads)
        if self.dp_size == 1 or self.dp_group is None:
            return 0, 0
        if not self.active(iteration):
            _bucketed_all_reduce(grads, self.dp_group)
            return raw, raw
        sent, mats, true, seconds = self._reduce(grads, iteration)
        self.record_stats(mats, true, seconds)
        return sent, raw

    def record_stats(self, mats, true, seconds) -> None:
        if self.stats is not None:
            # One timer covers the compressed part (the factors of all matrices share two
            # all-reduces); `ms` in the log is that time per compressed matrix.
            for (i, g, m, p, resid), t in zip(mats, true):
                self.stats.record(self.stage, self.kind, raw_bytes=g.numel() * g.element_size(),
                                  sent_bytes=p.element_size() * p.shape[1] * (m.shape[0] + m.shape[1]),
                                  true=t, decoded=matrix_view(g), residual=resid, p=p)
            if mats:
                self.stats.add_time(self.stage, self.kind, seconds)

    def split(self, grads: Sequence[torch.Tensor], indices: Sequence[int]):
        """(vectors reduced uncompressed, matrices [index, grad, M incl. error, P, residual]);
        `indices` key each gradient's warm start and residual (its position in the reduced list)."""
        vectors: List[torch.Tensor] = []
        mats = []
        for i, g in zip(indices, grads):
            if g.dim() < 2 or not self._compressible(g.shape[0], g[0].numel()):
                vectors.append(g)
                continue
            m = matrix_view(g).to(torch.promote_types(g.dtype, torch.float32))
            if self.error_feedback:
                e = self.state.take_error((i,), m.shape)
                if e is not None:
                    m = m + e.to(m.device)
            mats.append([i, g, m, None, None])
        return vectors, mats

    def true_sums(self, mats) -> list:
        """Diagnostic only (--log-compression-stats): the exact sums, to measure what the
        compressed ones missed."""
        if self.stats is None or not mats:
            return []
        return _flat_all_reduce([matrix_view(g).to(torch.promote_types(g.dtype, torch.float32)).clone()
                                 for _, g, _, _, _ in mats], self.dp_group)

    def _reduce(self, grads, iteration):
        vectors, mats = self.split(grads, range(len(grads)))
        true = self.true_sums(mats)
        sent = sum(v.numel() * v.element_size() for v in vectors)
        if vectors:
            _bucketed_all_reduce(vectors, self.dp_group)
        if not mats:
            return sent, mats, true, 0.0
        timer = Timer(mats[0][2].device) if self.stats is not None else contextlib.nullcontext()
        with timer:
            sent += self._compress(mats, iteration)
        return sent, mats, true, getattr(timer, "seconds", 0.0)

    def _compress(self, mats, iteration) -> int:
        """Replace each matrix's gradient by the group sum's rank-r approximation; returns bytes sent."""
        flat_p = _flat_all_reduce(self.local_p(mats, iteration), self.dp_group)
        return self.finish_compress(mats, flat_p)

    def local_p(self, mats, iteration) -> List[torch.Tensor]:
        """This rank's M Q (or M Omega) per matrix: the first all-reduce's payload."""
        widths = [self._width(m.shape[0], m.shape[1]) for _, _, m, _, _ in mats]
        if self.method == "RandomizedSVD":
            starts = [lowrank.initial_q(m.shape[1], w, self.state.seed, ("rsvd", i, iteration)).to(m.device, m.dtype)
                      for (i, _, m, _, _), w in zip(mats, widths)]
        else:
            starts = [self.state.q_for((i,), m.shape[1], w, m.device) for (i, _, m, _, _), w in zip(mats, widths)]
        return [m @ q.to(m.dtype) for (_, _, m, _, _), q in zip(mats, starts)]

    def finish_compress(self, mats, flat_p: List[torch.Tensor]) -> int:
        """From the summed P's: orthonormalise, the second all-reduce (Q), write each gradient;
        returns the bytes both all-reduces sent."""
        ps_ = [lowrank.orthonormalize(p) for p in flat_p]
        qs = _flat_all_reduce([m.t() @ p for (_, _, m, _, _), p in zip(mats, ps_)], self.dp_group)
        for row, p, q in zip(mats, ps_, qs):
            i, g, m = row[0], row[1], row[2]
            if self.method == "RandomizedSVD":
                approx = lowrank.truncate(p, q, self.rank)
            else:
                approx = lowrank.decompress(p, q)
                self.state.q[(i,)] = q.detach().cpu()
            if self.error_feedback:
                row[4] = m - approx / self.dp_size
                self.state.error[(i,)] = row[4].detach().cpu()
            row[3] = p
            g.copy_(approx.reshape(g.shape).to(g.dtype))
        return sum((p.numel() + q.numel()) * p.element_size() for p, q in zip(ps_, qs))

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_state_dict(sd)


def _flat_all_reduce(tensors: List[torch.Tensor], group) -> List[torch.Tensor]:
    """One all-reduce for all factors of a step (they are small; latency dominates)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    out, off = [], 0
    for t in tensors:
        out.append(flat[off:off + t.numel()].view_as(t))
        off += t.numel()
    return out
