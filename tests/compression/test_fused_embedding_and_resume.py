"""Fused embedding sync equals the unfused sync (TP=1 and TP=2); resume with compression is exact."""
import pytest
import torch

from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
from megatron.compression.embedding import fused_embedding_group_ranks
from megatron.config.core import CompressionConfig, ConfigError
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, make_trainer, shards, tiny_config


def test_one_group_per_tp_rank_over_first_and_last_stages_of_every_replica():
    # tp-dp-pp order: global = pp * (dp * tp) + dp * tp + tp
    assert fused_embedding_group_ranks(tp=2, dp=2, pp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert fused_embedding_group_ranks(tp=1, dp=2, pp=3) == [[0, 1, 4, 5]]


def _grads(rank, world, tp, fused):
    cfg = tiny_config(world=world, tp=tp, pp=2, iters=1)
    cfg.compression = CompressionConfig(emb_comm_opt=fused)
    t = make_trainer(cfg)
    got = []
    zero = t.optimizer.zero_grad

    def snap():
        got.append(shards(t, "grad"))
        # The last stage's tied copy is skipped by shards(): check it holds the same sum.
        for stage in t.stages.values():
            for p in stage.parameters():
                if getattr(p, "shared_embedding", False):
                    got.append(p.grad.clone())
        zero()

    t.optimizer.zero_grad = snap
    t.train()
    return got, t.ps.dp_rank


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_embedding_sync_equals_unfused(tp):
    world = 4 * tp
    plain = run_distributed(_grads, world, tp, False)
    fused = run_distributed(_grads, world, tp, True)
    a = assemble([o[0][0] for o in plain])
    b = assemble([o[0][0] for o in fused])
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for (p, _), (f, _) in zip(plain, fused):
        if len(p[0]) > 1 and len(p) > 1:  # last stage: its tied copy
            torch.testing.assert_close(f[1], p[1], atol=1e-6, rtol=1e-5)


TOTAL = 4
# LEP residuals carried across iterations, so the checkpoint holds pipeline residuals too
# (by default they end with their iteration and a checkpoint has none).
CB_ALL = dict(inter_grad_comp=True, inter_grad_comp_rank=2, use_error_feedback=True, grad_comp=True,
              grad_comp_rank=2, grad_comp_warm_up=0.25, emb_comm_opt=True, lep_carry_across_iterations=True)


def _cfg(save=None, load=None, iters=TOTAL, fmt="torch"):
    cfg = tiny_config(world=4, pp=2, iters=iters, dropout=0.1, save=save, load=load)
    cfg.training.lr_decay_iters = TOTAL
    cfg.checkpoint.ckpt_format = fmt
    cfg.compression = CompressionConfig(**CB_ALL)
    return cfg


def _straight(rank, world):
    t = make_trainer(_cfg())
    hist = t.train()
    return shards(t), [h["loss"] for h in hist]


def _first(rank, world, ckpt, fmt):
    t = make_trainer(_cfg(save=ckpt, iters=TOTAL // 2, fmt=fmt))
    t.train()
    save_checkpoint(t)


def _second(rank, world, ckpt, fmt):
    t = make_trainer(_cfg(load=ckpt, fmt=fmt))
    assert load_checkpoint(t)
    # Residuals differ per DP replica: each rank must get its own back.
    err = t.grad_compressor.state.error if t.ps.pp_rank == 1 else {}
    hist = t.train()
    return shards(t), [h["loss"] for h in hist], bool(err)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_with_every_compression_on_is_exact(tmp_path, fmt):
    straight = run_distributed(_straight, 4)
    run_distributed(_first, 4, str(tmp_path), fmt)
    resumed = run_distributed(_second, 4, str(tmp_path), fmt)
    assert straight[-1][1][TOTAL // 2:] == resumed[-1][1]
    assert any(r[2] for r in resumed)
    for (a, _), (b, _, _) in zip(straight, resumed):
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name


@pytest.mark.parametrize("kw,world,pp,match", [
    (dict(inter_grad_comp=True), 2, 1, "--inter-grad-comp .* --pipeline-model-parallel-size > 1"),
    (dict(grad_comp=True), 2, 2, "--grad-comp .* data-parallel size > 1"),
    (dict(emb_comm_opt=True), 2, 1, "--emb-comm-opt"),
])
def test_flags_that_cannot_apply_are_named(kw, world, pp, match):
    from megatron.config.core import MegatronConfig
    base = tiny_config(world=world, pp=pp)
    with pytest.raises(ConfigError, match=match):
        MegatronConfig(model=base.model, parallel=base.parallel, training=base.training, data=base.data,
                       compression=CompressionConfig(**kw))
    with pytest.raises(ConfigError, match="--selective-grad-comp needs --grad-comp"):
        CompressionConfig(selective_grad_comp=True, selective_grad_comp_way=1)


def _tied_after_powersgd(rank, world):
    cfg = tiny_config(world=4, pp=2, iters=3)
    cfg.compression = CompressionConfig(grad_comp=True, grad_comp_rank=2, use_error_feedback=True)
    t = make_trainer(cfg)
    t.train()
    return t.ps.pp_rank, [p.detach().clone() for p in t.tied_params]


def test_powersgd_keeps_both_copies_of_a_tied_embedding_equal():
    """PowerSGD compresses each stage's copy of the tied word embeddings over DP, then the
    embedding sync sums the two (Megatron's order). Syncing first and compressing each copy with
    its own warm start let the copies drift apart: a torch_dist resume, which keeps one copy,
    then left the uninterrupted run's losses by 2e-4."""
    out = run_distributed(_tied_after_powersgd, 4)
    first = [tied for pp, tied in out if pp == 0]
    last = [tied for pp, tied in out if pp == 1]
    assert first and last and all(len(t) == 1 for t in first + last)
    for a, b in zip(first, last):
        assert torch.equal(a[0], b[0]), f"tied copies differ by {(a[0] - b[0]).abs().max().item():.3e}"
