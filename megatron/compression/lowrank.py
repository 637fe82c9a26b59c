"""Rank-r compression by one warm-started power-iteration step (PowerSGD).

For a matrix M (n x m) and the previous right factor Q (m x r):
    P = M Q;  P <- orthonormal basis of P;  Q = M^T P;  M ~ P Q^T.
P and Q are what crosses the wire; (n + m) r values instead of n m. Q is kept and reused as
the next call's starting point, which is what makes one iteration per step enough: over
successive steps it converges towards M's leading right singular vectors.

If rank(M) <= r the result is exact: P spans M's column space, so P P^T M = M.
"""
from __future__ import annotations

import zlib
from typing import Dict, Optional, Tuple

import numpy as np
import torch


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning at least p's column space (reduced QR).

    Householder QR keeps the columns orthonormal even when p is rank-deficient, which Gram-
    Schmidt (the published code) does not; the extra columns then span unused directions and
    cancel in P P^T M because M has no component along them."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


def effective_rank(rows, cols, rank):
    """min(rank, rows, cols), at least 0: numbers, or numpy arrays (the planner prices grids)."""
    if isinstance(rows, np.ndarray) or isinstance(cols, np.ndarray):
        return np.maximum(0, np.minimum(np.minimum(rank, rows), cols))
    return max(0, min(rank, rows, cols))


def worth_compressing(rows, cols, rank, raw_per_factor=1.0):
    """Only compress when the two factors are smaller than the matrix itself, in bytes: this is
    the rule the plan's wire shapes, the executor and the simulator share. `raw_per_factor`: bytes
    of one raw value over bytes of one factor value (1 for float32 messages and float32 factors;
    0.5 for fp16/bf16 messages, whose factors still travel in float32)."""
    r = effective_rank(rows, cols, rank)
    return (r >= 1) & ((rows + cols) * r < rows * cols * raw_per_factor)


def wire_bytes(rows, cols, rank, raw_bytes, raw_itemsize=4):
    """Bytes one (rows, cols) gradient matrix puts on the wire at compression rank `rank`: its
    float32 factors when compressing is worth it, else `raw_bytes` (numbers or numpy arrays);
    `raw_itemsize`: bytes per raw value (2 for fp16/bf16 activations)."""
    r = effective_rank(rows, cols, rank)
    return np.where(worth_compressing(rows, cols, rank, raw_itemsize / 4.0), (rows + cols) * r * 4.0, raw_bytes)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """View an activation gradient [..., h] as (tokens, h): the hidden dimension is where
    the low-rank structure lives; tokens vary from micro-batch to micro-batch."""
    return t.reshape(-1, t.shape[-1])


def initial_q(cols: int, rank: int, seed: int, key) -> torch.Tensor:
    """A deterministic random start for Q, the same on every rank and after a restart."""
    # crc32 of the key's text, not hash(): string hashing is salted per process.
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(repr(key).encode())) & 0x7FFFFFFFFFFF)
    # Drawn in float32, held in the default dtype: a float64 run (the parity tests) starts from
    # the float32 run's values and keeps its factors in float64.
    return torch.randn(cols, rank, generator=g, dtype=torch.float32).to(torch.get_default_dtype())


def restore_rank(q: torch.Tensor, fresh) -> torch.Tensor:
    """A warm start `q` (cols x r) with full column rank, else its lost columns replaced.

    Q = M^T P of the previous message has rank <= rank(M), and a message whose rows are partly
    zero (the gradients of right-padded positions are exactly 0) leaves a Q of lower rank. The
    next power step then spans only rank(Q) directions of its message, even at r = cols, where
    compression is otherwise exact (measured: a DynaPipe x TeraPipe run at full rank lost 29 %
    of a gradient). Columns the QR finds dependent are replaced by the fixed random start
    (`fresh()`), projected off the columns kept, at the kept columns' scale; a full-rank `q` is
    returned unchanged."""
    work = torch.promote_types(q.dtype, torch.float32)
    qq, rr = torch.linalg.qr(q.to(work), mode="reduced")
    d = rr.diagonal().abs()
    top = float(d.max()) if d.numel() else 0.0
    lost = d <= top * 1e-5 * max(q.shape)
    if top > 0 and not bool(lost.any()):
        return q
    out = q.to(work).clone()
    r = fresh().to(out)
    kept = qq[:, ~lost]
    r = r - kept @ (kept.t() @ r)
    scale = top if top > 0 else 1.0
    out[:, lost] = r[:, lost] / r[:, lost].norm(dim=0).clamp_min(1e-30) * scale
    return out.to(q.dtype)


def compress(m: torch.Tensor, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One power step from `q`: returns (P orthonormal, Q = M^T P), both float32 (float64 for
    a float64 M)."""
    m = m.to(torch.promote_types(m.dtype, torch.float32))
    p = orthonormalize(m @ q.to(m.device, m.dtype))
    return p, m.t() @ p


def decompress(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p @ q.t()


class LowRankState:
    """Warm-start Q matrices and error-feedback residuals, keyed by the caller.

    Kept on the CPU between uses (they are small next to the activations) and saved in
    checkpoints, so a resumed run continues with exactly the same compressor state."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.q: Dict[tuple, torch.Tensor] = {}
        self.error: Dict[tuple, torch.Tensor] = {}

    def q_for(self, key: tuple, cols: int, rank: int, device) -> torch.Tensor:
        q = self.q.get(key)
        if q is None or tuple(q.shape) != (cols, rank):
            return initial_q(cols, rank, self.seed, key).to(device)
        return restore_rank(q, lambda: initial_q(cols, rank, self.seed, key)).to(device)

    def take_error(self, key: tuple, shape) -> Optional[torch.Tensor]:
        """The residual left by an earlier message with this key and shape, removed from the
        store (the caller folds it in and stores the new one)."""
        e = self.error.get(key)
        if e is not None and tuple(e.shape) == tuple(shape):
            del self.error[key]
            return e
        return None

    def state_dict(self) -> dict:
        return {"seed": self.seed,
                "q": {k: v.cpu() for k, v in self.q.items()},
                "error": {k: v.cpu() for k, v in self.error.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.seed = sd.get("seed", self.seed)
        self.q = {tuple(k) if isinstance(k, list) else k: v.clone() for k, v in sd.get("q", {}).items()}
        self.error = {tuple(k) if isinstance(k, list) else k: v.clone() for k, v in sd.get("error", {}).items()}


def truncate(p: torch.Tensor, q: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-`rank` approximation of P Q^T when P has orthonormal columns (the randomized
    SVD's last step): P Q^T = P U S V^T with U S V^T the SVD of the small Q^T."""
    u, s, vh = torch.linalg.svd(q.t(), full_matrices=False)
    r = min(rank, s.numel())
    return (p @ u[:, :r]) @ (s[:r, None] * vh[:r])
