"""Checkpoints: bit-exact resume, atomic saves, and clear errors for mismatched or broken files."""
import os

import pytest
import torch

from megatron.checkpointing import (TRACKER, CheckpointError, checkpoint_path, load_checkpoint, read_tracker,
                                    save_checkpoint)
from tests.dist_harness import RankFailed, run_distributed
from tests.parity_utils import make_trainer, shards, tiny_config

TOTAL = 4


def _cfg(world, ckpt_dir=None, load=None, iters=TOTAL, **kw):
    cfg = tiny_config(world=world, iters=iters, dropout=0.1, save=ckpt_dir, load=load, **kw)
    cfg.training.lr_decay_iters = TOTAL  # same schedule whether or not the run is split
    return cfg


def _straight(rank, world, kw):
    t = make_trainer(_cfg(world, **kw))
    t.train()
    return shards(t), t.consumed_samples


def _first_half(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, ckpt, iters=TOTAL // 2, **kw))
    t.train()
    save_checkpoint(t)
    return True


def _second_half(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, load=ckpt, **kw))
    assert load_checkpoint(t)
    assert t.iteration == TOTAL // 2
    t.train()
    return shards(t), t.consumed_samples


@pytest.mark.parametrize("world,kw", [(1, {}), (4, dict(tp=2, pp=2))])
def test_resume_is_bit_exact(tmp_path, world, kw):
    straight = run_distributed(_straight, world, kw)
    run_distributed(_first_half, world, str(tmp_path), kw)
    assert read_tracker(str(tmp_path)) == TOTAL // 2
    resumed = run_distributed(_second_half, world, str(tmp_path), kw)
    for (a, ca), (b, cb) in zip(straight, resumed):
        assert ca == cb
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name


def _load_expect_error(rank, world, ckpt, kw):
    t = make_trainer(tiny_config(world=world, load=ckpt, **kw))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_layout_mismatch_names_every_flag(tmp_path):
    run_distributed(_first_half, 2, str(tmp_path), dict(tp=2))
    msgs = run_distributed(_load_expect_error, 2, str(tmp_path), dict(pp=2))
    # Saved at TP=2, PP=1; loading at TP=1, PP=2: the TP=1/PP=2 file name does not exist.
    assert "mp_rank_00_000" in msgs[0] and "another TP/PP layout" in msgs[0]


def _mismatch(rank, world, ckpt):
    t = make_trainer(tiny_config(world=world, load=ckpt, hidden=48))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_model_mismatch_names_flag(tmp_path):
    run_distributed(_first_half, 1, str(tmp_path), {})
    (msg,) = run_distributed(_mismatch, 1, str(tmp_path))
    assert "--hidden-size: checkpoint has 32, this run has 48" in msg


def test_truncated_file_and_bad_tracker(tmp_path):
    run_distributed(_first_half, 1, str(tmp_path), {})
    path = checkpoint_path(str(tmp_path), TOTAL // 2, 0, 0, 1)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 3])
    (msg,) = run_distributed(_load_expect_error, 1, str(tmp_path), {})
    assert "cannot read checkpoint" in msg and path in msg
    open(os.path.join(tmp_path, TRACKER), "w").write("garbage")
    with pytest.raises(CheckpointError, match="tracker file is corrupt"):
        read_tracker(str(tmp_path))


def _save_crashing(rank, world, ckpt):
    t = make_trainer(_cfg(world, ckpt))
    for _ in range(TOTAL // 2):
        t.train_step()
    save_checkpoint(t)
    t.train_step()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt("simulated crash in the middle of a save")

    torch.save = dying_save
    try:
        save_checkpoint(t)
    except KeyboardInterrupt:
        pass
    finally:
        torch.save = real_save
    return True


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    run_distributed(_save_crashing, 1, str(tmp_path))
    assert read_tracker(str(tmp_path)) == TOTAL // 2
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    run_distributed(_second_half, 1, str(tmp_path), {})  # still loads and trains
