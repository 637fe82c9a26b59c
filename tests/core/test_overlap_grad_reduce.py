"""--overlap-grad-reduce: buckets all-reduced during the backward passes give the same training."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, shards, tiny_config, tolerance_inputs
from tests.test_training_parity import _compare

pytestmark = pytest.mark.parity


def _run(rank, world, kw, overlap, bucket=None):
    cfg = tiny_config(world=world, **kw)
    cfg.training.overlap_grad_reduce = overlap
    cfg.training.ddp_bucket_size = bucket
    t = make_trainer(cfg)
    grads, launched = [], []
    zero = t.optimizer.zero_grad

    def snap():  # every step's gradients bound the parameters' tolerance
        grads.append(shards(t, "grad"))
        if t.overlap_reducer is not None:
            launched.append(t.overlap_reducer.overlapped)
        zero()

    t.optimizer.zero_grad = snap
    hist = t.train()
    return {"loss": [h["loss"] for h in hist], "grad_norm": [h["grad_norm"] for h in hist], "grads": grads,
            "params": shards(t, "param"), "is_last": t.ps.rank == world - 1, "launched": launched,
            "buckets": len(t.overlap_reducer.buckets) if t.overlap_reducer else 0, **tolerance_inputs(cfg)}


@pytest.mark.parametrize("world,kw", [(2, {}), (4, dict(pp=2))])
def test_overlapped_buckets_equal_the_plain_all_reduce(world, kw):
    plain = run_distributed(_run, world, kw, False)
    over = run_distributed(_run, world, kw, True, 2000)
    _compare(plain, over)
    for o in over:
        assert o["buckets"] > 3
        # Every bucket became final during the last backward and was launched there.
        assert all(n == o["buckets"] for n in o["launched"]), o["launched"]


def test_overlap_with_the_distributed_optimizer_is_refused():
    from megatron.config import ConfigError
    from megatron.config import TrainingConfig
    with pytest.raises(ConfigError, match="--overlap-grad-reduce"):
        TrainingConfig(overlap_grad_reduce=True, use_distributed_optimizer=True)
