"""What the training step does for MoE layers: the auxiliary losses' scale before the pipeline
runs, the expert-bias update after the backward passes, and the per-layer log lines.

* `before_step(loss_multiplier)`: every MoE layer's aux losses enter with the multiplier of the
  main loss (megatron/models/moe/layer.py explains the weighting).
* `after_backward()`: aux-loss-free balancing (--moe-router-enable-expert-bias): each router's
  token counts, summed over every rank of its pipeline stage (EP group, then expert-DP group:
  together all TP x DP ranks), move its bias by rate * sign(mean - count) (Megatron-Core's
  `_update_router_expert_bias`, at the same point of the step).
* `report(...)`: at --log-interval, one line per MoE layer on the last rank (and TensorBoard
  scalars `moe/...`): the step's tokens per expert as max/mean load, and each aux loss's mean
  value per micro-batch divided by its coefficient (as Megatron logs them: a balanced router's
  load_balancing_loss is 1.0). One all-reduce over the world per logged step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.models.moe.layer import moe_layers, set_loss_multiplier
from megatron.models.moe.router import expert_bias_routers
from megatron.core.comm_device import to_comm

AUX_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def _stage_sum(t: torch.Tensor, ps) -> torch.Tensor:
    for g in (ps.ep_group, ps.edp_group):
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(t, group=g)
    return t


class MoEHooks:
    def __init__(self, cfg, ps, modules):
        self.cfg, self.ps = cfg, ps
        self.layers = moe_layers(modules)
        self.routers = expert_bias_routers(modules)
        self.num_layers = sum(cfg.model.moe.moe_layers(cfg.model.num_layers))

    def before_step(self, loss_multiplier: float) -> None:
        set_loss_multiplier(self.layers, loss_multiplier)

    def after_backward(self) -> None:
        if not self.routers:
            return
        counts = _stage_sum(torch.stack([r.local_tokens_per_expert for r in self.routers]), self.ps)
        for r, n in zip(self.routers, counts):
            r.update_expert_bias(n)

    def report(self, iteration: int, logger) -> None:
        log = iteration % self.cfg.logging.log_interval == 0 or iteration == 1
        if not log:
            for m in self.layers:
                m.stats.reset()
            return
        e = self.cfg.model.moe.num_experts
        pattern = self.cfg.model.moe.moe_layers(self.cfg.model.num_layers)
        index = {layer: i for i, layer in enumerate(j for j, is_moe in enumerate(pattern) if is_moe)}
        # rows: [tokens per expert (E), aux losses..., forwards] per MoE layer of the model
        table = torch.zeros(max(self.num_layers, 1), e + len(AUX_NAMES) + 1, dtype=torch.float64)
        mine = torch.zeros_like(table)
        for m in self.layers:
            row = mine[index[m.layer_number]]
            if torch.is_tensor(m.stats.load):
                row[:e] = m.stats.load.cpu()
            for k, name in enumerate(AUX_NAMES):
                if name in m.stats.aux:
                    row[e + k] = float(m.stats.aux[name])
            row[-1] = m.stats.forwards
            m.stats.reset()
        table += mine
        if self.ps.world_size > 1:
            table = to_comm(table)  # NCCL takes device tensors only (core/comm_device.py)
            dist.all_reduce(table)
            table = table.cpu()
        if not logger.active:
            return
        # every rank of a stage added its forwards: per micro-batch = sum / forwards over the stage
        # (TP ranks' shares of one micro-batch's loss sum to it, so divide by TP once more)
        tp = self.ps.tp_size
        for layer, i in sorted(index.items()):
            row = table[i]
            load = row[:e]
            fwd = max(float(row[-1]) / tp, 1.0)
            mean = float(load.mean()) or 1.0
            parts = [f"moe layer {layer:3d}", f"max/mean expert load: {float(load.max()) / mean:.3f}"]
            for k, name in enumerate(AUX_NAMES):
                if row[e + k] != 0:
                    parts.append(f"{name}: {float(row[e + k]) / fwd:.6E}")
                    if logger.writer is not None:
                        logger.writer.add_scalar(f"moe/{name}_layer_{layer}", float(row[e + k]) / fwd, iteration)
            if self.cfg.model.moe.per_layer_logging:
                parts.append("tokens per expert: " + ",".join(str(int(v)) for v in load))
            if logger.writer is not None:
                logger.writer.add_scalar(f"moe/max_over_mean_load_layer_{layer}", float(load.max()) / mean, iteration)
            print(" " + " | ".join(parts) + " |", flush=True)
