"""Low-rank tensor-parallel all-reduces (Optimus-CC's --mp-grad-comp / --mp-acti-comp).

Megatron's TP layers all-reduce twice per block: the input gradient of a column-parallel
layer in backward ("grad") and the output of a row-parallel layer (and of the vocabulary-
parallel embedding) in forward ("act"). Each is a sum over the TP group of a [..., h] tensor,
viewed as (tokens, h). Compressed, each rank sends rank-r factors instead:
    P = sum_k M_k Omega;  P <- orth(P);  Q = sum_k M_k^T P;  sum ~ P Q^T,
two all-reduces of (tokens + h) r values instead of one of tokens h.

Unlike the pipeline and data-parallel compressors, the sketch Omega is fixed (drawn once per
(kind, h, rank) from the seed) rather than warm-started from the last call: the result is
then a deterministic function of the summed tensor, so activation recomputation reproduces
the forward exactly and there is no state to checkpoint. No error feedback: an activation's
residual has no later message it could ride on.

The forward activation all-reduce changes the forward itself (the model computes with an
approximate sum, its backward passes gradients straight through as for the exact sum), so it
is opt-in on its own flag. If the rank covers the summed tensor's rank the result equals the
exact sum (P spans its column space).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron.compression import lowrank
from megatron.compression.stats import Timer
from megatron.core.tensor_parallel import mappings


class LowRankTPAllReduce:
    def __init__(self, kind: str, rank: int, seed: int = 0, stage: int = 0, only_if_smaller: bool = True):
        self.kind, self.rank, self.seed, self.stage = kind, rank, seed, stage
        # False forces the factors even when they are not smaller than the tensor (the
        # exactness tests use it to run the codec at full rank).
        self.only_if_smaller = only_if_smaller
        self.omega = {}
        self.stats = None  # a CompressionStats with --log-compression-stats
        self.sent_bytes = self.raw_bytes = 0

    def _omega(self, cols: int, r: int, device) -> torch.Tensor:
        key = (cols, r)
        if key not in self.omega:
            self.omega[key] = lowrank.initial_q(cols, r, self.seed, ("tp", self.kind))
        return self.omega[key].to(device)

    def __call__(self, x: torch.Tensor, group) -> torch.Tensor:
        m = lowrank.as_matrix(x)
        rows, cols = m.shape
        r = lowrank.effective_rank(rows, cols, self.rank)
        raw = x.numel() * x.element_size()
        self.raw_bytes += raw
        if r < 1 or (self.only_if_smaller and not lowrank.worth_compressing(rows, cols, self.rank)):
            out = x.clone().contiguous()
            dist.all_reduce(out, group=group)
            self.sent_bytes += raw
            return out
        timer = Timer(x.device) if self.stats is not None else contextlib.nullcontext()
        with timer:
            mf = m.to(torch.promote_types(m.dtype, torch.float32))
            p = mf @ self._omega(cols, r, mf.device).to(mf.dtype)
            dist.all_reduce(p, group=group)
            p = lowrank.orthonormalize(p)
            q = mf.t() @ p
            dist.all_reduce(q, group=group)
            out = lowrank.decompress(p, q)
        sent = p.element_size() * (p.numel() + q.numel())
        self.sent_bytes += sent
        if self.stats is not None:
            true = mf.clone()
            dist.all_reduce(true, group=group)  # diagnostic only: the exact sum
            self.stats.record(self.stage, f"tp_{self.kind}", raw_bytes=raw, sent_bytes=sent, seconds=timer.seconds,
                              true=true, decoded=out, p=p)
        return out.reshape(x.shape).to(x.dtype)


def install(cfg, ps, stats=None) -> dict:
    """Install the hooks --mp-grad-comp / --mp-acti-comp ask for; returns them by kind."""
    c = cfg.compression
    hooks = {}
    for kind, on, rank in (("grad", c.mp_grad_comp, c.mp_grad_comp_rank), ("act", c.mp_acti_comp, c.mp_acti_comp_rank)):
        if on:
            hooks[kind] = LowRankTPAllReduce(kind, rank, seed=cfg.training.seed, stage=ps.pp_rank)
            hooks[kind].stats = stats
    for kind in ("grad", "act"):
        mappings.ALL_REDUCE_HOOKS[kind] = hooks.get(kind)
    return hooks


def uninstall() -> None:
    for kind in ("grad", "act"):
        mappings.ALL_REDUCE_HOOKS[kind] = None

