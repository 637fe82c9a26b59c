"""--terapipe in the trainer: the fixed global batches of the Megatron baseline, run as token
slices by plans from `megatron.planner.terapipe.lowering`. Nothing else in the training loop changes:
the executor slices each micro-batch as the plan's `token_slice`s say."""
from __future__ import annotations

from megatron.planner.terapipe.planner import terapipe_planner
from megatron.training.trainer import FixedBatchSource, Trainer


class TeraPipeBatchSource(FixedBatchSource):
    def next(self, iteration: int, consumed_samples: int):
        work = super().next(iteration, consumed_samples)
        work.info = dict(self.planner.info)
        return work


def keyed_dropout(trainer, cfg, ps):
    """Dropout masks keyed by (seed, iteration, sequence, site, token position, ...): equal for
    every slicing; distinct per data-parallel rank (equal across TP ranks, as hidden states are)."""
    trainer.executor.dropout_seed = cfg.training.seed * 1009 + ps.dp_rank
    return trainer


def terapipe_trainer(cfg, ps, device, stages, train_ds, valid_ds, tied, flops):
    """Pretraining data (--data-path / --mock-data): fixed global batches, sliced. Multi-task
    data goes through `megatron.training.supervised`'s sources with a `terapipe_planner`."""
    from megatron.training.batching import gpt_microbatch
    from megatron.training.trainer import gpt_microbatch_shapes
    planner = terapipe_planner(cfg, ps)
    source = TeraPipeBatchSource(cfg, ps, train_ds, gpt_microbatch, planner, gpt_microbatch_shapes)
    valid = TeraPipeBatchSource(cfg, ps, valid_ds, gpt_microbatch, planner, gpt_microbatch_shapes) \
        if valid_ds is not None else None
    trainer = Trainer(cfg, ps, device, stages, tied_params=tied, flops_per_sample=flops, batch_source=source,
                      valid_source=valid)
    return keyed_dropout(trainer, cfg, ps)
