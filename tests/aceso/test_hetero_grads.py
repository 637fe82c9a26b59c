"""Stages with their own TP/DP sizes (--aceso-config layouts) with the gradient-side features:
the distributed optimizer and overlapped bucket reduction run over each stage's own DP group.

Every run here is exact (no compression): parity with the single-process run of the same
batches, under the derived bounds of tests/parity_utils.py."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, assert_parity, make_trainer, run_layout, shards, tiny_config, train_and_record

pytestmark = pytest.mark.parity

TP2_DP2 = dict(pp=2, stage_parallel=[[2, 1], [1, 2]], stage_layers=[1, 3])   # TP2 -> DP2
EMB = "embedding.word_embeddings.weight"
DP2_TP2 = dict(pp=2, stage_parallel=[[1, 2], [2, 1]], stage_layers=[2, 2])   # DP2 -> TP2


def hetero_run(rank, world, kw, **overrides):
    """run_layout with `overrides` ("section.field": value) applied and the configuration
    validated again, so a refused combination fails here as it would from the command line."""
    cfg = tiny_config(world=world, **kw)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.__post_init__()
    t = make_trainer(cfg)
    out = train_and_record(t, world)
    tied_copy = {}
    last = t.stages.get(t.ps.pp_size - 1)
    if last is not None and 0 not in t.stages and t.ps.dp_rank == 0:
        tied_copy = {EMB: (last.output_layer.weight.detach().clone(), 0, t.ps.tp_rank)}
    return dict(out, trainer_info=_info(t), tied_copy=tied_copy)


def check(reference, outs, compare_grads=True):
    """Parity with the single-process run, and the last stage's copy of the tied embedding
    (re-split between the stages' TP sizes) still equal to the first stage's."""
    assert_parity(reference, outs, compare_grads=compare_grads)
    emb = assemble([o["params"] for o in outs])[EMB]
    torch.testing.assert_close(assemble([o["tied_copy"] for o in outs])[EMB], emb, atol=0, rtol=0)


def _info(t):
    r = t.overlap_reducer
    return {"overlapped": r.overlapped if r is not None else 0, "buckets": len(r.buckets) if r is not None else 0,
            "dp_size": t.ps.dp_size, "shard": getattr(t.optimizer, "shard", None),
            "numel": getattr(t.optimizer, "numel", None)}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, {})


def test_distributed_optimizer_shards_over_each_stage_dp_group(reference):
    """--use-distributed-optimizer: a DP2 stage keeps half its Adam state per rank; the tied
    embedding (re-split between the two stages' TP sizes) is summed once, not DP times (the
    first stage runs DP2 here; TP2 -> DP2 is covered with overlap below). With --emb-comm-opt,
    which on these layouts names the re-split sync they always run."""
    outs = run_distributed(hetero_run, 4, DP2_TP2, **{"training.use_distributed_optimizer": True,
                                                       "compression.emb_comm_opt": True})
    check(reference, outs, compare_grads=False)  # gradients are sharded away (and clipped on the shards)
    for o in outs:
        i = o["trainer_info"]
        if i["dp_size"] == 2:
            assert i["shard"] * 2 - i["numel"] in (0, 1, 2), i


@pytest.mark.parametrize("dist_opt", [False, True], ids=["all-reduce", "distributed-optimizer"])
def test_overlapped_grad_reduce_over_each_stage_dp_group(reference, dist_opt):
    """--overlap-grad-reduce: small buckets reduced over the stage's own DP group during the
    backward passes (all-reduce, or the distributed optimizer's reduce-scatter)."""
    outs = run_distributed(hetero_run, 4, TP2_DP2, **{"training.overlap_grad_reduce": True,
                                                       "training.ddp_bucket_size": 2000,
                                                       "training.use_distributed_optimizer": dist_opt})
    check(reference, outs, compare_grads=not dist_opt)
    dp2 = [o["trainer_info"] for o in outs if o["trainer_info"]["dp_size"] == 2]
    assert len(dp2) == 2 and all(i["buckets"] > 3 and i["overlapped"] > 0 for i in dp2), dp2


RESUME = {"training.use_distributed_optimizer": True, "training.lr_decay_iters": 4,
          "compression.inter_grad_comp": True, "compression.inter_grad_comp_rank": 2,
          "compression.use_error_feedback": True, "compression.lep_carry_across_iterations": True,
          "compression.emb_grad_comp": True, "compression.emb_grad_comp_rank": 2,
          "compression.emb_use_error_feedback": True}


def _resume_run(rank, world, iters, save=None, load=None):
    from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
    cfg = tiny_config(world=world, iters=iters, save=save, load=load, **TP2_DP2)
    for key, value in RESUME.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.__post_init__()
    t = make_trainer(cfg)
    if load:
        assert load_checkpoint(t)
    # Stage 1 (DP2) keeps LEP residuals per row piece: each must come back to its own DP rank.
    residuals = sorted(map(str, t.grad_compressor.state.error)) if load else None
    hist = t.train()
    if save:
        save_checkpoint(t)
    return {"params": shards(t, "param"), "loss": [h["loss"] for h in hist], "residuals": residuals}


def test_resume_is_exact(tmp_path):
    """Save after 2 of 4 iterations and resume: the distributed optimizer's per-stage shards, the
    per-piece LEP residuals and the compressed embedding sync's state come back bit for bit."""
    straight = run_distributed(_resume_run, 4, 4)
    run_distributed(_resume_run, 4, 2, save=str(tmp_path))
    resumed = run_distributed(_resume_run, 4, 4, load=str(tmp_path))
    assert straight[-1]["loss"][2:] == resumed[-1]["loss"]
    assert any(r["residuals"] for r in resumed)
    for a, b in zip(straight, resumed):
        for name in a["params"]:
            assert torch.equal(a["params"][name][0], b["params"][name][0]), name
