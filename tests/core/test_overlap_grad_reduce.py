"""--overlap-grad-reduce: buckets all-reduced during the backward passes give the same training."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, run_layout, shards, tiny_config, tolerance_inputs
from tests.training.test_training_parity import _compare

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


def _run_distributed_optimizer(rank, world, kw, overlap_grad, overlap_param, bucket):
    cfg = tiny_config(world=world, **kw)
    cfg.training.use_distributed_optimizer = True
    cfg.training.overlap_grad_reduce = overlap_grad
    cfg.training.overlap_param_gather = overlap_param
    cfg.training.ddp_bucket_size = bucket
    t = make_trainer(cfg)
    launched = []
    zero = t.optimizer.zero_grad

    def snap():
        if t.overlap_reducer is not None:
            launched.append(t.overlap_reducer.overlapped)
        zero()

    t.optimizer.zero_grad = snap
    hist = t.train()
    return {"loss": [h["loss"] for h in hist], "grad_norm": [h["grad_norm"] for h in hist], "grads": [],
            "params": shards(t, "param"), "is_last": t.ps.rank == world - 1, "launched": launched,
            "buckets": len(t.optimizer.buckets), "late": len(t.optimizer.late_buckets), **tolerance_inputs(cfg)}


@pytest.mark.parametrize("world,kw", [(2, {}), (4, dict(pp=2))], ids=["dp2", "pp2_dp2"])
def test_distributed_optimizer_overlap_equals_the_plain_reduce_scatter(world, kw):
    """Bucketed reduce-scatters launched during the backward passes and asynchronous parameter
    all-gathers give the same losses, norms and parameters as one reduce-scatter after the
    pipeline (fp32). With PP=2 the tied embedding's bucket waits for the embedding sync."""
    plain = run_distributed(_run_distributed_optimizer, world, kw, False, False, None)
    over = run_distributed(_run_distributed_optimizer, world, kw, True, True, 2000)
    # The distributed optimizer shards the gradients away; the single-process run of the same
    # model supplies every step's full gradients, which the derived parameter bounds need.
    single = run_distributed(run_layout, 1, {})[0]["grads"]
    for i, o in enumerate(plain):
        o["grads"] = single if i == 0 else [{} for _ in single]
    _compare(plain, over)
    assert all(o["buckets"] == 1 for o in plain)
    for o in over:
        assert o["buckets"] > 3
        assert o["late"] == (1 if kw else 0)
        assert all(n == o["buckets"] - o["late"] for n in o["launched"]), o["launched"]


def test_overlap_param_gather_needs_the_distributed_optimizer():
    from megatron.config.core import ConfigError
    from megatron.config.core import TrainingConfig
    with pytest.raises(ConfigError, match="--overlap-param-gather"):
        TrainingConfig(overlap_param_gather=True)
