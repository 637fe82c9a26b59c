"""Top-k token-choice router with Megatron-Core's scoring, balancing losses and token dropping.

Tokens arrive flattened, [T, H] with T = s_local * b in [s, b] order (under sequence
parallelism each TP rank routes only its own chunk of the sequence). The router returns dense
[T, E] probabilities (0 where a token does not go) and a boolean [T, E] routing map.

Formulas (Megatron-Core `moe/router.py`, `moe/moe_utils.py`; docs/moe.md):
* z-loss       z = coeff / TP * mean_t logsumexp_e(logits)^2, attached to the logits;
* aux_loss     coeff * E / (k * T_tot^2) * sum_i (sum_t p_ti) * n_i, with p the full-E scores
               (softmax, or sigmoid normalised to sum 1), n_i the plain top-k counts summed over
               TP, T_tot = T * TP; attached to the probabilities;
* seq_aux_loss the same with the scores viewed as [s, b * E] (each sequence its own experts),
               divided by b;
* capacity     ceil(T * k / E * factor) per expert on this rank's tokens, before any exchange.
Losses are "attached" through `AuxLossScaler`: an identity in the forward whose backward adds
d(loss) = the layer's `aux_grad_scale` (see MoELayer), so they never travel with the activations.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.moe import MoEConfig
from megatron.core.tensor_parallel.layers import init_full
from megatron.core.tensor_parallel.mappings import group_size


class AuxLossScaler(torch.autograd.Function):
    """y = x in the forward; the backward also sends `scale()` into `loss` (Megatron's
    MoEAuxLossAutoScaler). `scale` is read at backward time: the trainer sets it per step."""

    @staticmethod
    def forward(ctx, x, loss, scale_fn):
        ctx.save_for_backward(loss)
        ctx.scale_fn = scale_fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (loss,) = ctx.saved_tensors
        return g, torch.full_like(loss, ctx.scale_fn()), None


def _all_reduce_counts(counts: torch.Tensor, tp_group) -> torch.Tensor:
    if group_size(tp_group) > 1:
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=tp_group)
    return counts


def switch_load_balancing_loss(probs, tokens_per_expert, total_tokens: int, topk: int, num_experts: int, coeff):
    """Megatron-Core's switch_load_balancing_loss_func (probabilities summed locally)."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (num_experts * coeff / (topk * total_tokens ** 2))


def capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    return int(math.ceil(num_tokens * topk / num_experts * factor))


def drop_tokens(probs, routing_map, cap: int, policy: str, pad: bool):
    """Keep at most `cap` tokens per expert (exactly `cap`, padding with zero-prob tokens, with
    `pad`): by highest probability, or by position (routed tokens first). Returns (probs, map)."""
    # position: a top-k of the 0/1 map along the tokens, as Megatron-Core's
    # apply_router_token_dropping takes it (which routed tokens survive is torch.topk's choice among ties)
    score = probs if policy == "probs" else routing_map.int()
    cap = min(cap, routing_map.shape[0])
    _, keep = torch.topk(score, k=cap, dim=0, sorted=False)
    keep_map = torch.zeros_like(routing_map).scatter(0, keep, True)
    if not pad:
        keep_map = keep_map & routing_map
    return probs * keep_map, keep_map


class TopKRouter(nn.Module):
    def __init__(self, cfg, moe: MoEConfig, tp_group, *, seed: int, key: str):
        super().__init__()
        self.moe, self.tp_group = moe, tp_group
        self.num_experts, self.topk = moe.num_experts, moe.router_topk
        self.weight = nn.Parameter(init_full((moe.num_experts, cfg.hidden_size), cfg.init_method_std, seed,
                                             key + ".weight"))
        # The router is replicated over TP; with sequence parallelism each rank saw other tokens.
        self.weight.sequence_parallel = cfg.sequence_parallel and group_size(tp_group) > 1
        if moe.router_enable_expert_bias:
            # DeepSeek-V3 aux-loss-free balancing: changes only which experts are chosen.
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.float64),
                                 persistent=False)
        else:
            self.expert_bias = None
        self.aux_grad_scale = lambda: 0.0  # set by MoELayer
        self.last_aux = {}  # the last forward's losses over their coefficients (this rank's share), for the log

    def _tp(self) -> int:
        return group_size(self.tp_group)

    def _scores(self, logits):
        """Full-E scores for the aux losses (Megatron's compute_routing_scores_for_aux_loss: the
        softmax in float32 and left there, the sigmoid in the logits' dtype)."""
        if self.moe.router_score_function == "softmax":
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        s = torch.sigmoid(logits)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)

    def routing(self, logits):
        """(probs [T, E] dense, routing_map [T, E] bool) before any dropping. Score functions run
        in float32 and are cast back to the logits' dtype, as Megatron-Core's
        topk_routing_with_score_function does (bf16 logits get a float32 softmax)."""
        k, moe = self.topk, self.moe
        if moe.router_score_function == "softmax":
            if moe.router_pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                probs, idx = torch.topk(scores, k, dim=-1)
            else:
                top, idx = torch.topk(logits, k, dim=-1)
                probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
            choose = scores + self.expert_bias.to(scores.dtype) if self.expert_bias is not None else scores
            _, idx = torch.topk(choose, k, dim=-1)
            probs = scores.gather(1, idx)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.router_topk_scaling_factor:
            probs = probs * moe.router_topk_scaling_factor
        dense = torch.zeros_like(logits).scatter(1, idx, probs)
        rmap = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        return dense, rmap

    def forward(self, x, seq_len: int, batch: int):
        """x: [T, H]. Returns (probs [T, E], routing_map [T, E])."""
        moe = self.moe
        logits = F.linear(x, self.weight)
        training = self.training and torch.is_grad_enabled()
        self.last_aux = {}
        if moe.z_loss_coeff and training:
            z = torch.logsumexp(logits, dim=-1).square().mean() * (moe.z_loss_coeff / self._tp())
            logits = AuxLossScaler.apply(logits, z, self.aux_grad_scale)
            self.last_aux["z_loss"] = z.detach() / moe.z_loss_coeff  # logged without the coefficient
        probs, rmap = self.routing(logits)
        if moe.expert_capacity_factor is not None:
            cap = capacity(logits.shape[0], self.num_experts, self.topk, moe.expert_capacity_factor)
            probs, rmap = drop_tokens(probs, rmap, cap, moe.token_drop_policy, moe.pad_expert_input_to_capacity)
        if training and moe.router_load_balancing_type != "none" and moe.aux_loss_coeff > 0:
            probs = self._attach_aux_loss(logits, probs, seq_len, batch)
        if training and self.expert_bias is not None:
            self.local_tokens_per_expert += rmap.sum(0).to(torch.float64)
        return probs, rmap

    def _attach_aux_loss(self, logits, probs, seq_len: int, batch: int):
        moe, tp = self.moe, self._tp()
        scores = self._scores(logits)
        _, idx = torch.topk(scores, self.topk, dim=-1)  # plain top-k: no bias, no dropping
        plain_map = torch.zeros_like(scores).scatter(1, idx, 1.0)
        if moe.router_load_balancing_type == "aux_loss":
            counts = _all_reduce_counts(plain_map.sum(0), self.tp_group)
            aux = switch_load_balancing_loss(scores, counts, logits.shape[0] * tp, self.topk, self.num_experts,
                                             moe.aux_loss_coeff)
            name = "load_balancing_loss"
        else:  # seq_aux_loss: every sequence is its own set of experts
            counts = _all_reduce_counts(plain_map.reshape(seq_len, -1).sum(0), self.tp_group)
            aux = switch_load_balancing_loss(scores.reshape(seq_len, -1), counts, seq_len * tp, self.topk,
                                             self.num_experts, moe.aux_loss_coeff) / batch
            name = "seq_load_balancing_loss"
        self.last_aux[name] = aux.detach() / moe.aux_loss_coeff  # as Megatron logs it: 1.0 = balanced
        return AuxLossScaler.apply(probs, aux, self.aux_grad_scale)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """bias += rate * sign(mean(n) - n) with n summed over every rank that routes tokens
        (Megatron's get_updated_expert_bias, called after the step's backward passes)."""
        if self.expert_bias is None:
            return
        n = tokens_per_expert.to(torch.float64)
        self.expert_bias += (torch.sign(n.mean() - n) * self.moe.router_bias_update_rate).to(self.expert_bias.dtype)
        self.local_tokens_per_expert.zero_()


def expert_bias_routers(modules) -> list:
    return [m for mod in modules for m in mod.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


def counts_group_sum(routers, group) -> Optional[torch.Tensor]:
    """Stack every router's local counts and sum them over `group` (one all-reduce)."""
    if not routers:
        return None
    stacked = torch.stack([r.local_tokens_per_expert for r in routers])
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(stacked, group=group)
    return stacked
