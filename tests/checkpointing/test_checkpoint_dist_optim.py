"""--ckpt-format torch_dist with --use-distributed-optimizer: the DP-sharded Adam moments are
saved per parameter at full shape (like the plain optimizer's), so the run resumes bit-exactly
at its own layout and continues at another DP size, or without the distributed optimizer."""
import os

import pytest
import torch

from megatron.checkpointing.torch_format import load_checkpoint
from megatron.checkpointing.dist_format import read_index
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, resume_cfg


@pytest.mark.parametrize("world,kw", [(2, {}), (4, dict(tp=2)), (2, dict(bucket=1000))])  # DP = 2
def test_distributed_optimizer_resume_is_bit_exact(tmp_path, world, kw):
    def check_saved(path):
        index = read_index(str(path / f"iter_{TOTAL // 2:07d}"))
        key = "optimizer.decoder.layers.3.self_attention.query_key_value.weight.exp_avg"
        # whole moments (not a DP shard): the full parameter's shape, TP gathered
        assert index[key][0] == index["model.decoder.layers.3.self_attention.query_key_value.weight"][0]
    assert_resume_bit_exact(tmp_path, world, dict(kw, fmt="torch_dist", dist_opt=True), check_saved)


def _losses(rank, world, ckpt, kw):
    t = make_trainer(resume_cfg(world, load=ckpt, fmt="torch_dist", dropout=0.0, **kw))
    if ckpt is not None:
        assert load_checkpoint(t) and t.iteration == TOTAL // 2
    return [h["loss"] for h in t.train()]


def test_distributed_optimizer_checkpoint_loads_at_another_dp_size(tmp_path):
    """Saved at DP = 2 (sharded moments); the second half at DP = 1 with the distributed
    optimizer, at DP = 1 with the plain one, at TP = 2 x DP = 2 and at DP = 2 with overlapped
    1000-element buckets gives the uninterrupted run's losses (fp32 reduction order only)."""
    ref = run_distributed(_losses, 2, None, dict(dist_opt=True))[-1][TOTAL // 2:]
    run_distributed(first_half, 2, str(tmp_path), dict(fmt="torch_dist", dropout=0.0, dist_opt=True))
    for world, kw in ((1, dict(dist_opt=True)), (1, {}), (4, dict(tp=2, dist_opt=True)), (2, dict(dist_opt=True, bucket=1000))):
        got = run_distributed(_losses, world, str(tmp_path), kw)[-1]
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), (world, kw, got, ref)


def test_plain_optimizer_checkpoint_loads_into_the_distributed_optimizer(tmp_path):
    ref = run_distributed(_losses, 1, None, {})[-1][TOTAL // 2:]
    run_distributed(first_half, 1, str(tmp_path), dict(fmt="torch_dist", dropout=0.0))
    got = run_distributed(_losses, 2, str(tmp_path), dict(dist_opt=True))[-1]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), (got, ref)


def _load_error(rank, world, ckpt):
    from megatron.checkpointing.torch_format import CheckpointError
    t = make_trainer(resume_cfg(world, load=ckpt, fmt="torch_dist", dist_opt=True))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_missing_shard_is_named(tmp_path):
    run_distributed(first_half, 2, str(tmp_path), dict(fmt="torch_dist", dist_opt=True))
    it_dir = tmp_path / f"iter_{TOTAL // 2:07d}"
    shard = sorted(f for f in os.listdir(it_dir) if f.endswith(".distcp"))[-1]
    os.remove(it_dir / shard)
    msgs = run_distributed(_load_error, 2, str(tmp_path))
    assert all("no torch_dist checkpoint" in m for m in msgs), msgs
    assert any(f"{it_dir / shard} is missing" in m for m in msgs), msgs
