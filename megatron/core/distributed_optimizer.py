"""Megatron's distributed optimizer (ZeRO-1): Adam state sharded over the data-parallel group.

All trainable parameters are laid out in one flat fp32 buffer, weight-decayed ones first, padded
to a multiple of the DP size and cut into DP equal shards. Per step:
  1. gradients are reduce-scattered (summed), so each rank holds the reduced gradient of its
     shard only: this replaces the data-parallel all-reduce;
  2. inf/nan check, global gradient norm and clipping on the shards (each element is counted
     once: replicated-over-TP values on TP rank 0 only, the tied copy of an embedding never);
  3. AdamW on the shard (two tensors at most: its weight-decayed and its undecayed part);
  4. the updated shards are all-gathered and copied back into the parameters.
Each rank keeps 1/DP of the Adam moments and an fp32 copy of its shard of the parameters (the
optimizer's tensors; the parameters are not one persistent flat buffer to take views of), so
per parameter a rank holds 4 (weight) + 4 (gradient) + 12 / DP bytes instead of 4 + 4 + 8; the
DynaPipe planner's memory model counts exactly that. step() also builds flat copies of the
parameters and gradients for the collectives (transient, 2 x the parameter bytes).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.optimizer import MegatronOptimizer, counts_for_norm


class DistributedOptimizer(MegatronOptimizer):
    reduces_data_parallel_grads = True

    def __init__(self, modules: List[nn.Module], cfg, ps, lr_scheduler, device=torch.device("cpu")):
        super().__init__(modules, cfg, ps, lr_scheduler, device)
        decay, no_decay = [], []
        for m in modules:
            for name, p in m.named_parameters():
                if p.requires_grad:
                    (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        self.ordered = decay + no_decay
        self.n_decay = sum(p.numel() for p in decay)
        self.numel = sum(p.numel() for p in self.ordered)
        dp = max(ps.dp_size, 1)
        self.shard = math.ceil(self.numel / dp)
        self.padded = self.shard * dp
        self.lo = ps.dp_rank * self.shard
        self.hi = min(self.lo + self.shard, self.numel)
        # Which shard elements count towards the global gradient norm on this rank.
        counts = torch.cat([torch.full((p.numel(),), counts_for_norm(p, ps.tp_rank), dtype=torch.bool)
                            for p in self.ordered] + [torch.zeros(self.padded - self.numel, dtype=torch.bool)])
        self.norm_mask = counts[self.lo:self.lo + self.shard].to(device)
        flat = self._flat_params()
        split = min(max(self.n_decay - self.lo, 0), self.shard)  # decayed elements of this shard
        self.main = [flat[self.lo:self.lo + split].clone(), flat[self.lo + split:self.lo + self.shard].clone()]
        self.split = split
        groups = []
        for t, wd in zip(self.main, (cfg.weight_decay, 0.0)):
            t.requires_grad_(True)
            groups.append({"params": [t], "weight_decay": wd})
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        if device.type == "cuda":
            kwargs["fused"] = True
        self.optimizer = torch.optim.AdamW(groups, **kwargs)

    def _flat_params(self) -> torch.Tensor:
        parts = [p.detach().reshape(-1) for p in self.ordered]
        pad = self.padded - self.numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        return torch.cat(parts)

    def _flat_grads(self) -> torch.Tensor:
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.ordered]
        pad = self.padded - self.numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        return torch.cat(parts)

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        ps = self.ps
        if ps.dp_size == 1 or ps.dp_group is None:
            return flat[self.lo:self.lo + self.shard].clone()
        out = flat.new_empty(self.shard)
        dist.reduce_scatter_tensor(out, flat, group=ps.dp_group)
        return out

    def _all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        ps = self.ps
        if ps.dp_size == 1 or ps.dp_group is None:
            return shard
        out = shard.new_empty(self.padded)
        dist.all_gather_into_tensor(out, shard.contiguous(), group=ps.dp_group)
        return out

    def step(self):
        # The parameters are the source of truth (a checkpoint load or a converter may have
        # changed them since the last step): refresh this rank's shard from them.
        flat = self._flat_params()
        with torch.no_grad():
            self.main[0].copy_(flat[self.lo:self.lo + self.split])
            self.main[1].copy_(flat[self.lo + self.split:self.lo + self.shard])
        grad = self._reduce_scatter(self._flat_grads())
        if self.grad_scaler is not None:
            grad.mul_(1.0 / self.grad_scaler.scale)
            flag = torch.tensor([0.0 if torch.isfinite(grad).all() else 1.0])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found_inf = bool(flag.item())
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        sq = grad.double().pow(2).masked_fill(~self.norm_mask, 0.0).sum().cpu().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)  # DP shards and TP / PP ranks together: every element once
        norm = math.sqrt(float(sq))
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            grad.mul_(self.cfg.clip_grad / (norm + 1e-6))
        self.main[0].grad = grad[:self.split].clone()
        self.main[1].grad = grad[self.split:].clone()
        lr = self.lr_scheduler.lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        flat = self._all_gather(torch.cat([self.main[0].detach(), self.main[1].detach()]))
        offset = 0
        with torch.no_grad():
            for p in self.ordered:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        return True, norm

    # Checkpoints hold each DP rank's shard with its range; `load_state_dict` accepts the
    # shards of any DP size (the flat layout does not depend on DP) and takes its own range.
    def state_dict(self):
        st = self.optimizer.state
        moments = {k: torch.cat([st[t][k] if t in st else torch.zeros_like(t) for t in self.main]).detach()
                   for k in ("exp_avg", "exp_avg_sq")}
        step = max((float(st[t]["step"]) for t in self.main if t in st), default=0.0)
        return {"distributed": True, "numel": self.numel, "range": (self.lo, self.lo + self.shard),
                "moments": moments, "step": step,
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}

    def load_state_dict(self, sd_or_shards):
        shards = sd_or_shards if isinstance(sd_or_shards, list) else [sd_or_shards]
        if not all(s.get("distributed") for s in shards):
            raise ValueError("the checkpoint's optimizer state was not saved by --use-distributed-optimizer; "
                             "load it with --no-load-optim or train without the flag")
        full = {k: torch.zeros(max(self.padded, max(s["range"][1] for s in shards))) for k in ("exp_avg", "exp_avg_sq")}
        for s in shards:
            a, b = s["range"]
            for k in full:
                full[k][a:b] = s["moments"][k]
        step = shards[0]["step"]
        for t, (a, b) in zip(self.main, ((self.lo, self.lo + self.split), (self.lo + self.split, self.lo + self.shard))):
            self.optimizer.state[t] = {"step": torch.tensor(step), "exp_avg": full["exp_avg"][a:b].clone().to(t.device),
                                       "exp_avg_sq": full["exp_avg_sq"][a:b].clone().to(t.device)}
        if self.grad_scaler is not None and shards[0].get("grad_scaler"):
            self.grad_scaler.load_state_dict(shards[0]["grad_scaler"])

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if torch.is_tensor(v))
