"""The MoE layer that replaces the dense MLP of the layers --moe-layer-freq selects.

[s, b, h] in (this rank's sequence chunk under sequence parallelism), [s, b, h] out:
router -> dispatcher -> local experts -> combine, plus the shared expert (an ordinary
tensor-parallel MLP over all tokens, --moe-shared-expert-intermediate-size).

Loss accounting. This trainer's loss is the sum of per-token losses times
``loss_scale / (loss tokens of the global batch)`` (pipeline/executor.py): Megatron-Core's
--calculate-per-token-loss. As there, each micro-batch's auxiliary losses enter with weight
(tokens of the micro-batch over the TP group) x that multiplier: `loss_multiplier` is set by
the trainer before each step (`set_loss_multiplier`), and the router's `AuxLossScaler` sends
that scale into the loss in the backward.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.core.tensor_parallel.mappings import group_size
from megatron.models.moe.dispatcher import build_dispatcher
from megatron.models.moe.experts import LocalExperts
from megatron.models.moe.router import TopKRouter


class MoELayer(nn.Module):
    def __init__(self, cfg, tp_group, *, ep_group=None, ep_rank: int = 0, seed: int, key: str, out_std: float,
                 layer_number: int, dense_mlp=None):
        """`dense_mlp`: the dense MLP class (transformer.ParallelMLP) the shared expert is built from."""
        super().__init__()
        moe = cfg.moe
        self.moe, self.layer_number, self.tp_group = moe, layer_number, tp_group
        ep = group_size(ep_group)
        num_local = moe.num_experts // ep
        self.first_expert = ep_rank * num_local
        self.router = TopKRouter(cfg, moe, tp_group, seed=seed, key=key + ".router")
        self.experts = LocalExperts(cfg, moe, first_expert=self.first_expert, num_local=num_local, seed=seed,
                                    key=key + ".experts", out_std=out_std)
        sp_tp = cfg.sequence_parallel and group_size(tp_group) > 1
        for p in self.experts.parameters():
            if ep > 1:
                p.expert_parallel = True  # summed over the expert-data-parallel group (grad_sync)
            elif sp_tp:
                p.sequence_parallel = True  # replicated over TP; each TP rank saw its own tokens
        self.dispatcher = build_dispatcher(moe, ep_group, ep_rank)
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            shared_cfg = dataclasses.replace(cfg, ffn_hidden_size=moe.shared_expert_intermediate_size, moe=None,
                                             add_bias_linear=False)
            self.shared_experts = dense_mlp(shared_cfg, tp_group, seed=seed, key=key + ".shared_experts",
                                            out_std=out_std)
        self.loss_multiplier = 0.0
        self.stats = MoEStats(moe.num_experts)

    def forward(self, x):
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        tokens_over_tp = s * b * group_size(self.tp_group)
        self.router.aux_grad_scale = lambda: self.loss_multiplier * tokens_over_tp
        probs, rmap = self.router(flat, s, b)
        out = self.dispatcher(flat, probs, rmap, self.experts).view(s, b, h)
        if self.training and torch.is_grad_enabled():
            self.stats.add(rmap, self.router.last_aux)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class MoEStats:
    """What the log reports per layer: tokens routed to each expert (after dropping, this rank's
    tokens) and the auxiliary losses' values, summed over the step's micro-batches."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self):
        self.load = 0  # summed on the device: read once per logged step, not once per forward
        self.aux = {}
        self.forwards = 0

    def add(self, rmap, aux: dict):
        self.load = self.load + rmap.sum(0).detach().to(torch.float64)
        for k, v in aux.items():
            self.aux[k] = self.aux.get(k, 0) + v.detach().to(torch.float64)
        self.forwards += 1


def moe_layers(modules) -> list:
    return [m for mod in modules for m in mod.modules() if isinstance(m, MoELayer)]


def set_loss_multiplier(layers, value: float) -> None:
    for m in layers:
        m.loss_multiplier = value
