"""Context parallelism with the rest of the trainer, each equal to the single-process run
(fp32, parity_utils' derived bounds): dropout (masks keyed by token position: the reference is
the CP 1 run with --cp-keyed-dropout), recompute, sequence parallelism, RoPE, the distributed
optimizer, packed multi-task rows and padded multi-task micro-batches, and a checkpoint saved at
one CP size resumed at others."""
import dataclasses

import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, make_trainer, run_layout, tiny_config, train_and_record
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (the data fixture)

pytestmark = pytest.mark.parity
SP = {"sequence_parallel": True}
ROPE = {"position_embedding_type": "rope"}


@pytest.mark.parametrize("world,kw", [
    (2, dict(cp=2)),
    (2, dict(cp=2, cp_comm="p2p", recompute="full")),
    (4, dict(cp=2, tp=2, arch=SP, recompute="selective")),
], ids=["cp2", "cp2_p2p_full_recompute", "cp2_tp2_sp_selective"])
def test_cp_dropout_matches_keyed_single_process(world, kw):
    # One step: loss, grad norm, every gradient and the updated parameters. (Over 3 steps a
    # handful of weights drift ~10% past parity_utils' Adam bound in CP runs with dropout: the
    # step-1 gradients agree to 1e-10, but elements whose gradient is at rounding level move by
    # up to lr either way in Adam's first step, and that drift reaches the next steps' gradients
    # through the forward, which the bound does not model. Without dropout 3 steps pass.)
    ref = run_distributed(run_layout, 1, dict(dropout=0.2, cp_keyed=True, arch=kw.get("arch"), iters=1))
    # The ring merges each arriving block into the running softmax sums after rescaling them by
    # exp(m_old - m_new): one more rounding of the reduction than the one-pass softmax, which
    # is parity_utils' formula 4 (codec_roundings=1).
    ring = int(kw.get("cp_comm") == "p2p")
    got = run_distributed(run_layout, world, dict(kw, dropout=0.2, iters=1), timeout_s=180)
    assert_parity(ref, got, codec_roundings=ring)


def test_cp_sequence_parallel_rope_matches_single_process():
    ref = run_distributed(run_layout, 1, dict(arch=ROPE))
    assert_parity(ref, run_distributed(run_layout, 4, dict(cp=2, tp=2, arch=dict(SP, **ROPE)), timeout_s=180))


def _distopt(rank, world, kw):
    cfg = tiny_config(world=world, **kw)
    cfg.training.use_distributed_optimizer = True
    return train_and_record(make_trainer(cfg), world)


def test_cp_distributed_optimizer_shards_over_dp_x_cp():
    ref = run_distributed(run_layout, 1, {})
    # DP 2 x CP 2 shards; gradients are sharded away (as in tests/core/test_distributed_optimizer.py)
    assert_parity(ref, run_distributed(_distopt, 4, dict(cp=2, pp=1), timeout_s=180), compare_grads=False)


# -- checkpoints do not depend on the CP size ------------------------------------------------
def _cfg(world, ckpt, iters, kw, load=False):
    cfg = tiny_config(world=world, iters=iters, save=None if load else ckpt, load=ckpt if load else None, **kw)
    cfg.training.use_distributed_optimizer = True
    cfg.training.lr_decay_iters = 4
    return cfg


def _save(rank, world, ckpt, kw):
    from megatron.checkpointing.torch_format import save_checkpoint
    t = make_trainer(_cfg(world, ckpt, 2, kw))
    t.train()
    save_checkpoint(t)


def _resume(rank, world, ckpt, kw):
    from megatron.checkpointing.torch_format import load_checkpoint
    t = make_trainer(_cfg(world, ckpt, 4, kw, load=True))
    assert load_checkpoint(t) and t.iteration == 2
    return train_and_record(t, world)


def test_checkpoint_saved_at_cp2_resumes_at_cp1_cp4_and_cp2_dp2(tmp_path):
    run_distributed(_save, 2, str(tmp_path), dict(cp=2), timeout_s=180)
    ref = run_distributed(_resume, 1, str(tmp_path), {})
    # (distributed optimizer: gradients are sharded away; losses, norms and parameters compared)
    assert_parity(ref, run_distributed(_resume, 4, str(tmp_path), dict(cp=4), timeout_s=180), compare_grads=False)
    assert_parity(ref, run_distributed(_resume, 4, str(tmp_path), dict(cp=2), timeout_s=180),  # CP 2 x DP 2
                  compare_grads=False)


# -- multi-task data: packed rows (documents anywhere in a chunk) and padded micro-batches ----
def _multitask(rank, world, data, mode, cp, pp=1, tp=1):
    from datetime import timedelta

    import torch

    import tests.training.test_dynapipe_training as td
    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    cfg = td._cfg(world, "gpt", data, mode, pp=pp, tp=tp)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp))
    cfg.model.vocab_size = td.VOCAB
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    return train_and_record(build_gpt_trainer(cfg, ps, torch.device("cpu")), world)


@pytest.mark.parametrize("mode,world,cp,pp,tp", [("packing", 2, 2, 1, 1), ("packing", 4, 2, 2, 1),
                                                ("fixed", 4, 4, 1, 1), ("fixed", 4, 2, 1, 2),
                                                # DynaPipe plans a static CP group's micro-batches
                                                ("dynapipe", 2, 2, 1, 1), ("dynapipe", 4, 2, 2, 1)])
def test_cp_multitask_equals_whole_batch_step(multitask, mode, world, cp, pp, tp):  # noqa: F811
    import tests.training.test_dynapipe_training as td
    ref = run_distributed(td._train, 1, "gpt", multitask, "whole")
    outs = run_distributed(_multitask, world, multitask, mode, cp, pp, tp, timeout_s=240)
    td._check(ref, outs)
    if mode == "dynapipe":  # DynaPipe's own plans ran: padded to 2 x CP chunks, cut into micro-batches
        info = [o for o in outs if o["is_last"]][0]["info"]
        assert all(i["planner"] == "dynapipe" for i in info)
        assert max(i["num_microbatches"][0] for i in info) > 1
        assert all(shape[1] % (2 * cp) == 0 for i in info for shape in i["microbatch_shapes"])
