"""No hidden host syncs in the training step: the executor, the loss accounting, the optimizer
and the logging read device values back a fixed number of times per step (the loss-token count
the plan's loss multiplier needs, the loss, the gradient norm), never once per micro-batch or
per parameter. Counted on CPU by intercepting every read-back call of torch."""
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron.config.core import (DataConfig, LoggingConfig, MegatronConfig, ModelConfig, ParallelConfig,
                             TrainingConfig)
from megatron.core.parallel_state import ParallelState
from megatron.training.initialize import set_seeds
from megatron.training.pretrain import build_gpt_trainer

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch.optim.AdamW reads each parameter's step count on CPU; on CUDA it runs fused,
        # with the counts on the device, so those reads are not the trainer's.
        if func in READS and not self.paused and "torch/optim" not in sys._getframe(1).f_code.co_filename:
            self.count += 1
        return func(*args, **(kwargs or {}))


class UncountedSource:
    """The data pipeline (reading samples, collating) runs on the host before the step: its
    Python-side reads are not device syncs and are left out of the count."""

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter

    def next(self, *a):
        self.counter.paused = True
        try:
            return self.inner.next(*a)
        finally:
            self.counter.paused = False


def reads_per_step(num_micro: int, steps: int, monkeypatch, **training) -> float:
    cfg = MegatronConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                          hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=num_micro, train_iters=steps, lr=1e-3,
                                **training),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=2))
    ps, dev = ParallelState(), torch.device("cpu")
    set_seeds(cfg.training.seed, ps, dev)
    trainer = build_gpt_trainer(cfg, ps, dev)
    counter = CountReads()
    trainer.batch_source = UncountedSource(trainer.batch_source, counter)
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    with counter:
        history = trainer.train()
    assert len(history) == steps and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    return (counter.count + len(syncs)) / steps


@pytest.mark.parametrize("training,limit", [({}, 5), ({"fp16": True}, 7)], ids=["fp32", "fp16-loss-scaling"])
def test_reads_per_step_do_not_grow_with_microbatches(training, limit, monkeypatch):
    few = reads_per_step(2, 3, monkeypatch, **training)
    many = reads_per_step(12, 3, monkeypatch, **training)
    assert few == many, f"{few} reads per step with 2 micro-batches, {many} with 12"
    # token count, loss (read + all-reduce), gradient norm (read + item); fp16: the inf check
    assert many <= limit
