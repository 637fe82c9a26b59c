"""The DynaPipe planner as the trainer, the plan service and the experiment drivers use it:
`DynaPipePlanner(config)` is the planner of `megatron.planner.dynapipe.base` with the systems
that compose with it switched on by the config: virtual stages
(`config.virtual_stages > 1`: `dynapipe_interleaved.InterleavedDynaPipePlanner`) and token
slices of GPT micro-batches (`config.token_slices`: `dynapipe_slicing.plan_sliced` after the
base planner's search). The base and the composed planners import only downward; this module
sits above them all.
"""
from __future__ import annotations

from typing import Optional

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.dynapipe.base import (DynaPipeBase, DynaPipeIterationPlan, GroupPlan,  # noqa: F401
                                            PlanningError, sp_memory_factor)
from megatron.planner.dynapipe.config import DynaPipeConfig
from megatron.planner.dynapipe.interleaved import InterleavedDynaPipePlanner
from megatron.planner.dynapipe.slicing import plan_sliced
from megatron.planner.dynapipe import lockstep
from megatron.planner.dynapipe.partitioner import PartitionError, balance_groups


class DynaPipePlanner(DynaPipeBase):
    def __new__(cls, config: DynaPipeConfig, cost_model: Optional[CostModel] = None):
        if cls is DynaPipePlanner and config.virtual_stages > 1:  # every caller gets the interleaved planner
            return InterleavedDynaPipePlanner(config, cost_model)
        return super().__new__(cls)

    # Expert parallelism (`config.lockstep_groups`, megatron/planner/dynapipe/lockstep.py): every DP
    # group the same number of micro-batches and the same passes per pipeline rank.
    def _partitions(self, rc, fit, orders, enc_all, dec_all, errors):
        got = super()._partitions(rc, fit, orders, enc_all, dec_all, errors)
        if not self.cfg.lockstep_groups:
            return got
        out = []
        for order, p in got:
            try:
                out.append((order, lockstep.equalize(p, self.segment_times(rc, fit, enc_all[order], None, sides=True),
                                                     self.cfg.data_parallel)))
            except PartitionError as e:
                errors.append(f"recompute={rc}, fit={fit}: {e}")
        return out

    def _dp_groups(self, times, k):
        return (lockstep.balance_equal if self.cfg.lockstep_groups else balance_groups)(times, k)

    def plan(self, lengths, iteration: int = 0, validate: bool = True) -> DynaPipeIterationPlan:
        got = super().plan(lengths, iteration, validate)
        if self.cfg.lockstep_groups:
            lockstep.check_lockstep(got)
        return got

    def _after_refine(self, best, cands, orders, lengths, iteration, t_start, validate):
        c = self.cfg
        if c.token_slices and c.model_kind == "gpt":
            return plan_sliced(self, best, cands, orders, lengths, iteration, t_start, validate)
        return None


def plan_batch(lengths, config: DynaPipeConfig, iteration: int = 0,
               planner: Optional[DynaPipeBase] = None) -> DynaPipeIterationPlan:
    """Plan one global batch. `lengths`: GPT list[int]; T5 list[(input_len, target_len)].
    Pass a long-lived `planner` to reuse its cost caches across iterations."""
    return (planner or DynaPipePlanner(config)).plan(lengths, iteration)
