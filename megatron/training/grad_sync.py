"""Gradient synchronisation after the pipeline, as one object built once per run.

What a step must sum, and over which ranks, depends on the run's flags; `GradientSync` decides
it at construction and `reduce` runs it after the executor:
* sequence-parallel parameters (norm weights, row-parallel biases) over the TP group;
* tied embeddings (word embeddings of the first and last stage, T5's position tables): the
  plain sync over the embedding group, the fused sync over every DP replica (--emb-comm-opt),
  the low-rank reducer (--emb-grad-comp), or the re-split sync of stages with their own TP/DP;
* everything else over DP (x CP: context-parallel ranks saw other tokens of the same
  samples): all-reduce (bucketed), overlapped with the backward
  (--overlap-grad-reduce), PowerSGD (--grad-comp), or, with the distributed optimizer, its
  reduce-scatter (`optimizer.grads_reduced` marks what another sync already summed).
"""
from __future__ import annotations

from typing import List, Sequence

from megatron.core.distributed import (BUCKET_NUMEL, OverlappedGradReducer, allreduce_data_parallel_grads,
                                       allreduce_embedding_grads)


def _nbytes(params) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


class GradientSync:
    def __init__(self, cfg, ps, modules, tied_params: List, extra_tied_groups: Sequence[tuple] = (), *,
                 dp_reducer=None, emb_reducer=None, fused_embedding_group=None):
        self.cfg, self.ps = cfg, ps
        self.tied_params = tied_params
        # (params, group) pairs whose gradients are summed like tied embeddings, e.g. T5's learned
        # position tables shared by the first encoder and first decoder stage.
        self.extra_tied_groups = list(extra_tied_groups)
        self.dp_reducer, self.emb_reducer = dp_reducer, emb_reducer
        self.fused_embedding_group = fused_embedding_group
        self.sequence_parallel_params = [p for m in modules for p in m.parameters()
                                         if getattr(p, "sequence_parallel", False)]
        self.expert_params = [p for m in modules for p in m.parameters() if getattr(p, "expert_parallel", False)]
        self.bucket_numel = cfg.training.ddp_bucket_size or BUCKET_NUMEL
        self.overlap_reducer = None
        self.optimizer = None

    def late_params(self) -> list:
        """Gradients the tied-embedding / sequence-parallel syncs still change after the backward
        (the distributed optimizer's overlapped buckets must not send them early)."""
        return list(self.tied_params) + [p for params, _ in self.extra_tied_groups for p in params] \
            + self.sequence_parallel_params

    def attach(self, optimizer) -> None:
        """Bind the optimizer (its parameter list and, for the distributed optimizer, its
        reduce-scatter) and build the overlapped reducer if --overlap-grad-reduce asks for one."""
        self.optimizer = optimizer
        ps, t = self.ps, self.cfg.training
        if not (t.overlap_grad_reduce and ps.grad_size > 1):
            return
        # With per-stage TP/DP sizes or --emb-comm-opt the tied embedding's sync already spans
        # every DP replica (re-split / fused sync): the DP all-reduce must not sum it again.
        fused = ps.stage_layouts or self.fused_embedding_group is not None
        tied = {id(p) for p in self.tied_params} if fused else set()
        params = [p for p in optimizer.params if id(p) not in tied]
        if self.dp_reducer is not None:
            # --grad-comp: PowerSGD's first all-reduce per bucket during the backward passes.
            from megatron.compression.data_parallel_overlap import OverlappedPowerSGD
            self.overlap_reducer = OverlappedPowerSGD(params, self.dp_reducer, self.bucket_numel)
        else:
            self.overlap_reducer = OverlappedGradReducer(
                params, ps.grad_group, ps.grad_size, self.bucket_numel,
                optimizer=optimizer if t.use_distributed_optimizer else None)

    def reduce(self, optimizer, iteration: int) -> dict:
        """Run every sync of this step; returns payload bytes per mechanism (dp, dp_raw, emb)."""
        ps = self.ps
        sent = {"dp": 0, "dp_raw": 0, "emb": 0}
        if self.overlap_reducer is not None:
            # Sums commute: reducing over DP first, then over tied stages / TP, is the same.
            self.overlap_reducer.finish()
            sent["dp"] = sent["dp_raw"] = _nbytes(self.overlap_reducer.params)
            if hasattr(self.overlap_reducer, "sent"):
                sent["dp"], sent["dp_raw"] = self.overlap_reducer.sent
        if self.sequence_parallel_params:
            # Norm weights and row-parallel biases saw only this rank's sequence chunk.
            allreduce_data_parallel_grads(self.sequence_parallel_params, ps.tp_group, ps.tp_size)
        # With PowerSGD, Megatron's order (finalize_model_grads: the DP reduction, then the
        # embedding sync): each copy of a tied table is compressed on its own stage, and the sync
        # then gives both the same sum. Syncing first and compressing each stage's copy with its
        # own warm start drifts the copies apart (and a torch_dist resume, which keeps one copy,
        # off the uninterrupted run).
        dp_first = (self.overlap_reducer is None and self.dp_reducer is not None
                    and self.fused_embedding_group is None and not ps.stage_layouts)
        dp_params = optimizer.params if dp_first else self._sync_tied(optimizer, iteration, sent)
        if self.expert_params:
            # Experts split over EP ranks: each copy of an expert saw the tokens its EP group sent
            # it; the copies' sum is over the expert-data-parallel group, not over DP (the
            # distributed optimizer reduce-scatters them over that group itself).
            if not getattr(optimizer, "reduces_data_parallel_grads", False):
                allreduce_data_parallel_grads(self.expert_params, ps.edp_group, ps.edp_size, self.bucket_numel)
            dp_params = [p for p in dp_params if not getattr(p, "expert_parallel", False)]
        if getattr(optimizer, "reduces_data_parallel_grads", False):
            # The distributed optimizer reduce-scatters what no other sync summed over DP yet.
            if self.fused_embedding_group is not None:
                optimizer.grads_reduced(self.tied_params)
            if getattr(self.overlap_reducer, "all_reduces", False):  # overlapped PowerSGD summed them
                optimizer.grads_reduced(dp_params)
            elif self.dp_reducer is not None and self.dp_reducer.active(iteration):
                # PowerSGD leaves the (approximate) DP sum on every rank: the optimizer only cuts
                # its shard. Warm-up steps and stages --selective-grad-comp skips take the
                # reduce-scatter, which moves half the bytes of the all-reduce they would replace.
                sent["dp"], sent["dp_raw"] = self.dp_reducer.reduce(dp_params, iteration)
                if dp_first:
                    self._sync_tied(optimizer, iteration, sent)
                optimizer.grads_reduced(dp_params)
            elif dp_first:  # a warm-up step: the optimizer's exact reduce-scatter follows
                self._sync_tied(optimizer, iteration, sent)
            return sent
        if self.overlap_reducer is not None:
            pass  # reduced over DP above
        elif self.dp_reducer is not None:
            sent["dp"], sent["dp_raw"] = self.dp_reducer.reduce(dp_params, iteration)
            if dp_first:
                self._sync_tied(optimizer, iteration, sent)
        else:
            # over DP x CP: context-parallel ranks saw other tokens of the same samples
            allreduce_data_parallel_grads(dp_params, ps.grad_group, ps.grad_size, self.bucket_numel)
            if ps.grad_size > 1:
                sent["dp"] = sent["dp_raw"] = _nbytes(dp_params)
        return sent

    def _sync_tied(self, optimizer, iteration: int, sent: dict) -> list:
        """Sum the tied parameters' gradients; returns the parameters left for the DP reduction."""
        ps = self.ps
        dp_params = optimizer.params
        if self.fused_embedding_group is not None or ps.stage_layouts:
            # Both syncs already sum over every DP replica of the first and last stage: the
            # tied parameters stay out of the data-parallel reduction.
            vocab_rows = max(self.cfg.model.padded_vocab_size(tp) for tp, _ in ps.stage_layouts) \
                if ps.stage_layouts else 0
            if self.emb_reducer is not None and ps.stage_layouts:
                from megatron.compression.embedding import resharded_embedding_reduce
                sent["emb"] = resharded_embedding_reduce(self.emb_reducer, self.tied_params, ps, vocab_rows, iteration)
            elif self.emb_reducer is not None:
                sent["emb"] = self.emb_reducer.reduce(self.tied_params, iteration)[0]
            elif self.fused_embedding_group is not None:
                from megatron.compression.embedding import fused_embedding_all_reduce
                sent["emb"] = fused_embedding_all_reduce(self.tied_params, self.fused_embedding_group)
            else:
                from megatron.core.distributed import allreduce_resharded_embedding_grads
                sent["emb"] = allreduce_resharded_embedding_grads(self.tied_params, ps.embedding_group, ps.tp_rank,
                                                                  vocab_rows)
            tied = {id(p) for p in self.tied_params}
            if ps.stage_layouts:  # T5's position tables: likewise over every replica of their stages
                from megatron.core.distributed import allreduce_replicated_grads
                for params, group in self.extra_tied_groups:
                    allreduce_replicated_grads(params, group, ps.tp_rank == 0)
                    tied |= {id(p) for p in params}
            dp_params = [p for p in dp_params if id(p) not in tied]
            if getattr(optimizer, "reduces_data_parallel_grads", False) and ps.grad_rank \
                    and self.fused_embedding_group is None:
                # The distributed optimizer reduce-scatters every gradient over DP, the tied ones
                # too: one replica carries the (already complete) sum, exactly. (After the fused
                # sync it cuts their shard locally instead: `grads_reduced` in `reduce`.)
                for p in self.tied_params:
                    p.grad.zero_()
        elif self.emb_reducer is not None:
            sent["emb"] = self.emb_reducer.reduce(self.tied_params, iteration)[0]
        else:
            allreduce_embedding_grads(self.tied_params, ps.embedding_group)
            if ps.embedding_group is not None:
                sent["emb"] = _nbytes(self.tied_params)
        for params, group in ([] if ps.stage_layouts else self.extra_tied_groups):
            allreduce_embedding_grads(params, group)
        return dp_params
