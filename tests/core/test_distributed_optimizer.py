"""--use-distributed-optimizer: Adam state sharded over DP, same training as the plain optimizer."""
import pytest
import torch

from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.parity_utils import RTOL_64, assemble, assert_parity, make_trainer, shards, tiny_config, tolerance_inputs

pytestmark = pytest.mark.parity


def _run(rank, world, kw, distributed, iters=3):
    cfg = tiny_config(world=world, iters=iters, **kw)
    cfg.training.use_distributed_optimizer = distributed
    t = make_trainer(cfg)
    grads = []
    zero = t.optimizer.zero_grad

    def snapshot_then_zero():  # every step's gradients bound the parameters' tolerance
        grads.append(shards(t, "grad"))
        zero()
    t.optimizer.zero_grad = snapshot_then_zero
    history = t.train()
    state_bytes = sum(v.numel() * v.element_size() for st in t.optimizer.optimizer.state.values()
                      for v in st.values() if torch.is_tensor(v) and v.ndim > 0)
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "grads": grads if not distributed else [], "params": shards(t, "param"),
            "is_last": t.ps.rank == world - 1, "state_bytes": state_bytes, **tolerance_inputs(cfg)}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_run, 1, {}, False)


@pytest.mark.parametrize("world,kw", [(2, {}), (4, dict(tp=2)), (4, dict(pp=2))], ids=["dp2", "tp2_dp2", "pp2_dp2"])
def test_matches_single_process(reference, world, kw):
    outs = run_distributed(_run, world, kw, True)
    assert_parity(reference, outs, compare_grads=False)  # gradients are sharded away: losses, norms, params


def test_adam_state_is_sharded():
    plain = run_distributed(_run, 2, {}, False)
    sharded = run_distributed(_run, 2, {}, True)
    for p, s in zip(plain, sharded):
        assert s["state_bytes"] * 2 == pytest.approx(p["state_bytes"], rel=0.01), (p["state_bytes"], s["state_bytes"])


def _save(rank, world, ckpt):
    cfg = tiny_config(world=world, iters=2, save=ckpt)
    cfg.training.use_distributed_optimizer = True
    cfg.training.lr_decay_iters = 4  # the schedule of the whole 4-iteration run
    t = make_trainer(cfg)
    t.train()
    save_checkpoint(t)
    return True


def _resume(rank, world, ckpt, buckets=False):
    cfg = tiny_config(world=world, iters=4, load=ckpt)
    cfg.training.use_distributed_optimizer = True
    cfg.training.lr_decay_iters = 4
    if buckets:  # another layout of the shards: small buckets, overlapped
        cfg.training.overlap_grad_reduce = cfg.training.overlap_param_gather = True
        cfg.training.ddp_bucket_size = 3000
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    t.train()
    return shards(t, "param")


def _straight(rank, world):
    cfg = tiny_config(world=world, iters=4)
    cfg.training.use_distributed_optimizer = True
    cfg.training.lr_decay_iters = 4
    t = make_trainer(cfg)
    t.train()
    return shards(t, "param")


@pytest.mark.parametrize("resume_world,buckets", [(2, False), (1, False), (2, True)],
                         ids=["same_dp", "dp2_to_dp1", "one_bucket_to_overlapped_buckets"])
def test_checkpoint_resumes_also_at_another_dp_size(tmp_path, resume_world, buckets):
    straight = assemble(run_distributed(_straight, 2))
    run_distributed(_save, 2, str(tmp_path))
    resumed = assemble(run_distributed(_resume, resume_world, str(tmp_path), buckets))
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=RTOL_64, rtol=0, msg=lambda m: f"{name}: {m}")
