"""Megatron's distributed optimizer (ZeRO-1): Adam state sharded over the data-parallel group.

Trainable parameters are laid out in flat fp32 buckets, weight-decayed ones first in each,
each bucket padded to a multiple of the DP size and cut into DP equal chunks; a rank's shard is
its chunk of every bucket. Without overlap there is one bucket (the whole model). With
--overlap-grad-reduce the buckets follow the backward order (last layers first) so that
`OverlappedGradReducer` reduce-scatters each one while the backward passes still run; with
--overlap-param-gather the updated buckets are all-gathered asynchronously after the step and
each module's next forward waits only for the buckets holding its parameters. Per step:
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
Checkpoints store moments by position in one DP- and bucket-independent order (all decayed
parameters, then the rest), so any DP size or bucketing resumes from them.

Gradients another sync has already summed over DP (`grads_reduced`: a PowerSGD all-reduce with
--grad-comp, the fused first/last-stage x DP embedding sync of --emb-comm-opt) are identical on
every DP rank, so their shard is cut locally instead of reduce-scattered: summing them again
would count every replica DP times. `reduced_params` (the fused sync's tied embeddings) get a
bucket of their own so that no collective carries them at all.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.optimizer import MegatronOptimizer, counts_for_norm
from megatron.core.tensor_parallel.mappings import all_gather_flat, reduce_scatter_flat


PARTS = 3  # a bucket's parameter groups, in order: decayed, decayed with --decoupled-lr, undecayed


class _Bucket:
    """Parameters in one flat range, padded to a multiple of the DP size, grouped in PARTS order
    (decayed; the --decoupled-lr word embedding and output layer, also decayed; undecayed), so
    each rank's chunk cuts into one contiguous piece per optimizer parameter group."""

    def __init__(self, params: list, decayed: set, dp: int, dp_rank: int, decoupled: set = frozenset(),
                 group=None):
        self.group, self.size, self.rank = group, dp, dp_rank  # the ranks sharing this bucket's shards
        kinds = [[p for p in params if id(p) in decayed and id(p) not in decoupled],
                 [p for p in params if id(p) in decoupled], [p for p in params if id(p) not in decayed | decoupled]]
        self.params = [p for k in kinds for p in k]
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = math.ceil(self.numel / dp)
        self.padded = self.chunk * dp
        self.lo = dp_rank * self.chunk
        ends, end = [], 0
        for k in kinds:
            end += sum(p.numel() for p in k)
            ends.append(min(max(end - self.lo, 0), self.chunk))
        ends[-1] = self.chunk  # the padding goes with the undecayed part
        # this rank's chunk, as (start, end) of each part
        self.parts = [(0 if j == 0 else ends[j - 1], ends[j]) for j in range(PARTS)]

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [t.reshape(-1) for t in tensors]
        if self.padded > self.numel:
            parts.append(parts[0].new_zeros(self.padded - self.numel))
        return torch.cat(parts)

    def grads(self) -> torch.Tensor:
        return self.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])


def make_buckets(params: list, bucket_numel: Optional[int]) -> List[list]:
    """One bucket of everything, or buckets of about `bucket_numel` elements in backward order."""
    if not bucket_numel:
        return [list(params)]
    out, cur, size = [], [], 0
    for p in reversed(params):
        if cur and size + p.numel() > bucket_numel:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        out.append(cur)
    return out


class DistributedOptimizer(MegatronOptimizer):
    reduces_data_parallel_grads = True

    def __init__(self, modules: List[nn.Module], cfg, ps, lr_scheduler, device=torch.device("cpu"),
                 bucket_numel: Optional[int] = None, late_params: Sequence[nn.Parameter] = (),
                 reduced_params: Sequence[nn.Parameter] = (), decoupled_lr: Optional[tuple] = None):
        """`bucket_numel`: bucket size for --overlap-grad-reduce / --overlap-param-gather (None:
        one bucket). `late_params`: gradients that other syncs (tied embeddings, sequence-parallel
        norms) still change after the backward; they get a bucket of their own, reduced last.
        `reduced_params`: gradients another sync sums over DP every step (see the module
        docstring); a last bucket of their own, never reduce-scattered. `decoupled_lr`: (max_lr,
        min_lr) of the word embedding and output layer (Megatron's --decoupled-lr), as the plain
        optimizer's `param_groups` picks them."""
        super().__init__(modules, cfg, ps, lr_scheduler, device)
        decay, no_decay, own = [], [], set()
        for m in modules:
            for name, p in m.named_parameters():
                if p.requires_grad:
                    if decoupled_lr is not None and name.endswith(("word_embeddings.weight", "output_layer.weight")):
                        own.add(id(p))
                        decay.append(p)  # (both are matrices: decayed, as in `param_groups`)
                    else:
                        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        self.ordered = decay + no_decay
        decayed = {id(p) for p in decay}
        # Position of each parameter in the canonical (checkpoint) order.
        self.canon: Dict[int, int] = {}
        off = 0
        for p in self.ordered:
            self.canon[id(p)] = off
            off += p.numel()
        self.numel = off
        dp = max(ps.grad_size, 1)
        pre = {id(p) for p in reduced_params}
        late = {id(p) for p in late_params} | pre
        early = [p for m in modules for p in m.parameters() if p.requires_grad and id(p) not in late]
        lists = make_buckets(early, bucket_numel) if bucket_numel else [[p for p in self.ordered if id(p) not in pre]]
        if bucket_numel:
            lists.append([p for p in self.ordered if id(p) in late and id(p) not in pre])
        lists.append([p for p in self.ordered if id(p) in pre])
        # Expert-parallel parameters (EP > 1): each EP rank holds other experts, whose copies are
        # the expert-data-parallel group's (megatron/core/expert_parallel.py): one bucket of
        # their own, sharded, reduce-scattered and gathered over that group instead of DP.
        experts = {id(p) for p in self.ordered if getattr(p, "expert_parallel", False)}
        lists = [[p for p in b if id(p) not in experts] for b in lists]
        self.buckets = [_Bucket(b, decayed, dp, ps.grad_rank, own, ps.grad_group) for b in lists if b]
        if experts:
            self.buckets.append(_Bucket([p for p in self.ordered if id(p) in experts], decayed, max(ps.edp_size, 1),
                                        ps.edp_rank, own, ps.edp_group))
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.late_buckets = {self.bucket_of[k] for k in late if k in self.bucket_of} if bucket_numel else set()
        self._reduced_ids: set = set()  # this step's gradients already summed over DP
        self.shard = sum(b.chunk for b in self.buckets)
        # Which shard elements count towards the global gradient norm on this rank.
        masks = []
        for b in self.buckets:
            # (an expert shard element lives on one rank of the stage: EP x EDP covers it once)
            counts = torch.cat([torch.full((p.numel(),), counts_for_norm(p, ps.tp_rank) or id(p) in experts,
                                           dtype=torch.bool)
                                for p in b.params] + [torch.zeros(b.padded - b.numel, dtype=torch.bool)])
            masks.append(counts[b.lo:b.lo + b.chunk])
        self.norm_mask = torch.cat(masks).to(device)
        self.main: List[torch.Tensor] = []  # per bucket: its PARTS pieces of this rank's chunk (may be empty)
        for b in self.buckets:
            flat = b.flat([p.detach() for p in b.params])
            self.main += [flat[b.lo + lo:b.lo + hi].clone() for lo, hi in b.parts]
        groups = []
        extra = [{}, {} if decoupled_lr is None else {"max_lr": decoupled_lr[0], "min_lr": decoupled_lr[1]}, {}]
        for k, wd in enumerate((cfg.weight_decay, cfg.weight_decay, 0.0)):
            ts = self.main[k::PARTS]
            for t in ts:
                t.requires_grad_(True)
            groups.append({"params": ts, "weight_decay": wd, **extra[k]})
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        if device.type == "cuda":
            kwargs["fused"] = True
        self.optimizer = torch.optim.AdamW(groups, **kwargs)
        self.reduced: List[Optional[torch.Tensor]] = [None] * len(self.buckets)  # from the overlapped reducer
        self.overlap_param_gather = bool(getattr(cfg, "overlap_param_gather", False)) and dp > 1
        self.gathers: List[Optional[tuple]] = [None] * len(self.buckets)
        self._hooks = []
        # Modules that own parameters wait for their buckets when called. A parameter used
        # without calling its module (a tied or untied output weight in F.linear) would be
        # read stale, so the modules not called in the first step (before any gather is in
        # flight) have their buckets waited for at the start of the stage's forward.
        self._owner_buckets: Dict[int, tuple] = {}
        self._called: set = set()
        self._uncovered: Optional[tuple] = None
        if self.overlap_param_gather:
            for m in modules:
                self._hooks.append(m.register_forward_pre_hook(
                    lambda mod, args: self._wait_buckets(self._uncovered or ())))
                for sub in m.modules():
                    own = tuple(sorted({self.bucket_of[id(p)] for p in sub.parameters(recurse=False)
                                        if id(p) in self.bucket_of}))
                    if own:
                        self._owner_buckets[id(sub)] = own
                        self._hooks.append(sub.register_forward_pre_hook(
                            lambda mod, args, own=own, key=id(sub): self._on_forward(key, own)))

    def _on_forward(self, key: int, own: tuple) -> None:
        self._called.add(key)
        self._wait_buckets(own)

    # -- collectives on one bucket ---------------------------------------------------------
    def launch_reduce(self, i: int, grads: Sequence[torch.Tensor]):
        """Start bucket i's reduce-scatter (the overlapped reducer calls this during backward)."""
        b = self.buckets[i]
        flat = b.flat(grads)
        if b.size == 1 or b.group is None:
            return None, flat[b.lo:b.lo + b.chunk].clone()
        out = flat.new_empty(b.chunk)
        return reduce_scatter_flat(out, flat, group=b.group, async_op=True), out

    def complete_reduce(self, i: int, handle) -> None:
        work, out = handle
        if work is not None:
            work.wait()
        self.reduced[i] = out

    def grads_reduced(self, params: Sequence[nn.Parameter]) -> None:
        """This step's gradients of `params` are already the DP sum on every rank: the step
        takes their shard locally (one step only; the next one starts without the mark)."""
        self._reduced_ids |= {id(p) for p in params}

    def _local_shard(self, i: int) -> torch.Tensor:
        """Bucket i's shard of gradients some of which are already DP sums: those are cut
        locally; if the bucket also holds unreduced ones, one reduce-scatter sums them with
        the reduced ones entered by DP rank 0 only (adding zeros is exact)."""
        b = self.buckets[i]
        done = [id(p) in self._reduced_ids for p in b.params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        if all(done) or b.size == 1 or b.group is None:
            return b.flat(grads)[b.lo:b.lo + b.chunk].clone()
        if b.rank != 0:
            grads = [torch.zeros_like(g) if d else g for g, d in zip(grads, done)]
        work, out = self.launch_reduce(i, grads)
        work.wait()
        return out

    def _reduced_grad(self, i: int) -> torch.Tensor:
        if self.reduced[i] is None and any(id(p) in self._reduced_ids for p in self.buckets[i].params):
            return self._local_shard(i)
        if self.reduced[i] is None:
            self.complete_reduce(i, self.launch_reduce(i, [p.grad if p.grad is not None else torch.zeros_like(p)
                                                            for p in self.buckets[i].params]))
        g, self.reduced[i] = self.reduced[i], None
        return g

    def _gather(self, i: int, shard: torch.Tensor, async_op: bool):
        b = self.buckets[i]
        if b.size == 1 or b.group is None:
            return None, shard
        out = shard.new_empty(b.padded)
        return all_gather_flat(out, shard.contiguous(), group=b.group, async_op=async_op), out

    def _write_params(self, i: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.buckets[i].params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def _wait_buckets(self, indices) -> None:
        for i in indices:
            pending = self.gathers[i]
            if pending is not None:
                self.gathers[i] = None
                work, flat = pending
                if work is not None:
                    work.wait()
                self._write_params(i, flat)

    def finish_param_gather(self) -> None:
        """Bring every parameter up to date (before a checkpoint, an evaluation or the next step)."""
        self._wait_buckets(range(len(self.buckets)))

    def step(self):
        self.finish_param_gather()
        # The parameters are the source of truth (a checkpoint load or a converter may have
        # changed them since the last step): refresh this rank's shard from them.
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                flat = b.flat([p.detach() for p in b.params])
                for j, (lo, hi) in enumerate(b.parts):
                    self.main[PARTS * i + j].copy_(flat[b.lo + lo:b.lo + hi])
        grad = torch.cat([self._reduced_grad(i) for i in range(len(self.buckets))])
        self._reduced_ids = set()
        if self.grad_scaler is not None:
            grad.mul_(1.0 / self.grad_scaler.scale)
            flag = torch.isfinite(grad).all().logical_not().float().reshape(1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found_inf = bool(flag.item())
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        sq = grad.double().pow(2).masked_fill(~self.norm_mask, 0.0).sum().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)  # DP shards and TP / PP ranks together: every element once
        norm = math.sqrt(sq.item())
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            grad.mul_(self.cfg.clip_grad / (norm + 1e-6))
        off = 0
        for i, b in enumerate(self.buckets):
            for j, (lo, hi) in enumerate(b.parts):
                self.main[PARTS * i + j].grad = grad[off + lo:off + hi].clone()
            off += b.chunk
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_scheduler.lr(max_lr=g.get("max_lr"), min_lr=g.get("min_lr"))
        self.optimizer.step()
        if self.overlap_param_gather and self._uncovered is None:
            self._uncovered = tuple(sorted({b for key, own in self._owner_buckets.items() if key not in self._called
                                            for b in own}))
        # Forward order (first layers first): the next forward needs those first.
        for i in reversed(range(len(self.buckets))):
            shard = torch.cat([t.detach() for t in self.main[PARTS * i:PARTS * i + PARTS]])
            pending = self._gather(i, shard, self.overlap_param_gather)
            if self.overlap_param_gather:
                self.gathers[i] = pending
            else:
                self._write_params(i, pending[1])
        return True, norm

    def _pieces(self):
        """(canonical start, canonical end, offset in this rank's shard) of its real elements."""
        out, base = [], 0
        for b in self.buckets:
            pos = 0
            for p in b.params:
                a, e = max(pos, b.lo), min(pos + p.numel(), b.lo + b.chunk)
                if a < e:
                    c = self.canon[id(p)] + a - pos
                    out.append((c, c + e - a, base + a - b.lo))
                pos += p.numel()
            base += b.chunk
        return out

    # Checkpoints hold each DP rank's moments with where they sit in the canonical order;
    # `load_state_dict` accepts the shards of any DP size or bucketing and takes its own pieces.
    def state_dict(self):
        self.finish_param_gather()
        st = self.optimizer.state
        moments = {k: torch.cat([st[t][k] if t in st else torch.zeros_like(t) for t in self.main]).detach()
                   for k in ("exp_avg", "exp_avg_sq")}
        step = max((float(st[t]["step"]) for t in self.main if t in st), default=0.0)
        return {"distributed": True, "numel": self.numel, "pieces": self._pieces(),
                "moments": moments, "step": step,
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}

    def load_state_dict(self, sd_or_shards):
        shards = sd_or_shards if isinstance(sd_or_shards, list) else [sd_or_shards]
        if not all(s.get("distributed") for s in shards):
            raise ValueError("the checkpoint's optimizer state was not saved by --use-distributed-optimizer; "
                             "load it with --no-load-optim or train without the flag")
        self.finish_param_gather()
        # Older checkpoints: one contiguous "range" of the canonical order (padding past the end).
        pieces = [s["pieces"] if "pieces" in s else [(s["range"][0], s["range"][1], 0)] for s in shards]
        size = max([self.numel] + [e for ps_ in pieces for _, e, _ in ps_])
        full = {k: torch.zeros(size) for k in ("exp_avg", "exp_avg_sq")}
        for s, ps_ in zip(shards, pieces):
            for a, e, off in ps_:
                for k in full:
                    full[k][a:e] = s["moments"][k][off:off + e - a]
        mine = {k: torch.zeros(self.shard) for k in full}
        for a, e, off in self._pieces():
            for k in full:
                mine[k][off:off + e - a] = full[k][a:e]
        step = shards[0]["step"]
        off = 0
        for t in self.main:
            n = t.numel()
            self.optimizer.state[t] = {"step": torch.tensor(step),
                                       **{k: mine[k][off:off + n].clone().to(t.device) for k in mine}}
            off += n
        if self.grad_scaler is not None and shards[0].get("grad_scaler"):
            self.grad_scaler.load_state_dict(shards[0]["grad_scaler"])

    # --ckpt-format torch_dist: the moments per parameter (views into each bucket's moments
    # gathered over DP), so that any DP size, bucketing or a plain optimizer reads them back.
    def param_states(self) -> dict:
        """{id(param): {"step", "exp_avg", "exp_avg_sq"}} of every parameter of this rank's
        stages, whole (collective over the DP group; empty before the first step)."""
        self.finish_param_gather()
        st = self.optimizer.state
        if not any(t in st for t in self.main):
            return {}
        step = max(float(st[t]["step"]) for t in self.main if t in st)
        out = {}
        for i, b in enumerate(self.buckets):
            full = {}
            for k in ("exp_avg", "exp_avg_sq"):
                mine = self.main[PARTS * i:PARTS * i + PARTS]
                shard = torch.cat([st[t][k] if t in st else torch.zeros_like(t) for t in mine])
                full[k] = self._gather(i, shard.detach(), False)[1]
            pos = 0
            for p in b.params:
                n = p.numel()
                out[id(p)] = {"step": torch.tensor(step), **{k: v[pos:pos + n].view_as(p) for k, v in full.items()}}
                pos += n
        return out

    def load_param_states(self, states: dict) -> None:
        """The inverse of `param_states` (no collective): each rank cuts its shard; a parameter
        missing from `states` starts with zero moments. The parameters are read at the next
        step (see step()), so the caller loads them first or after, as it likes."""
        if not states:
            return
        step = max(float(s["step"]) for s in states.values())
        for i, b in enumerate(self.buckets):
            cut = {}
            for k in ("exp_avg", "exp_avg_sq"):
                dt = self.main[PARTS * i].dtype
                flat = b.flat([states[id(p)][k].to(p.device, dt) if id(p) in states
                               else torch.zeros(p.shape, dtype=dt, device=p.device) for p in b.params])
                cut[k] = flat[b.lo:b.lo + b.chunk]
            for j, (lo, hi) in enumerate(b.parts):
                t = self.main[PARTS * i + j]
                self.optimizer.state[t] = {"step": torch.tensor(step),
                                           **{k: v[lo:hi].clone().to(t.device) for k, v in cut.items()}}

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if torch.is_tensor(v))
