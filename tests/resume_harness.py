"""The resume experiment both checkpoint formats are tested with: train TOTAL iterations
straight, or TOTAL / 2, save, load in fresh trainers and train the rest; the two must end
bit-identical. `kw` is passed to `tiny_config`, plus `fmt` (the --ckpt-format) and `dist_opt`
(--use-distributed-optimizer) or `t5` (T5's `tiny_t5_config` arguments)."""
import torch

from megatron.checkpointing.torch_format import load_checkpoint, read_tracker, save_checkpoint
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer as _make_gpt, shards, tiny_config

TOTAL = 4


def resume_cfg(world, save=None, load=None, iters=TOTAL, fmt="torch", dropout=0.1, dist_opt=False, t5=None, compression=None,
               bucket=None, **kw):
    """`t5`: a dict of `tiny_t5_config` arguments to run T5 instead of GPT (no dropout);
    `compression`: CompressionConfig fields to set; `bucket`: --overlap-grad-reduce (and
    --overlap-param-gather with the distributed optimizer) with buckets of that many elements."""
    if t5 is not None:
        from tests.training.test_t5_parity import tiny_t5_config
        cfg = tiny_t5_config(world=world, iters=iters, **t5)
        cfg.checkpoint.save, cfg.checkpoint.load = save, load
    else:
        cfg = tiny_config(world=world, iters=iters, dropout=dropout, save=save, load=load, **kw)
    cfg.training.use_distributed_optimizer = dist_opt
    if bucket:
        cfg.training.overlap_grad_reduce, cfg.training.ddp_bucket_size = True, bucket
        cfg.training.overlap_param_gather = dist_opt
    for k, v in (compression or {}).items():
        setattr(cfg.compression, k, v)
    cfg.training.lr_decay_iters = TOTAL  # same schedule whether or not the run is split
    cfg.checkpoint.ckpt_format = fmt
    return cfg


def make_trainer(cfg):
    if cfg.model.model_type != "t5":
        return _make_gpt(cfg)
    from datetime import timedelta

    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.t5_builder import build_t5_trainer
    ps = initialize_parallel(cfg, timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    return build_t5_trainer(cfg, ps, torch.device("cpu"))


def straight(rank, world, kw):
    t = make_trainer(resume_cfg(world, **kw))
    t.train()
    return shards(t), t.consumed_samples


def first_half(rank, world, ckpt, kw):
    t = make_trainer(resume_cfg(world, ckpt, iters=TOTAL // 2, **kw))
    t.train()
    save_checkpoint(t)
    return shards(t)


def second_half(rank, world, ckpt, kw):
    t = make_trainer(resume_cfg(world, load=ckpt, **kw))
    assert load_checkpoint(t)
    assert t.iteration == TOTAL // 2
    t.train()
    return shards(t), t.consumed_samples


def assert_resume_bit_exact(tmp_path, world, kw, check_saved=None):
    """Run the experiment; `check_saved(tmp_path)` may inspect the checkpoint in between."""
    ref = run_distributed(straight, world, kw)
    run_distributed(first_half, world, str(tmp_path), kw)
    assert read_tracker(str(tmp_path)) == TOTAL // 2
    if check_saved is not None:
        check_saved(tmp_path)
    resumed = run_distributed(second_half, world, str(tmp_path), kw)
    for (a, ca), (b, cb) in zip(ref, resumed):
        assert ca == cb and set(a) == set(b)
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name
