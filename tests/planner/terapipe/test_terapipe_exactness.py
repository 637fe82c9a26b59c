"""Token-sliced execution (TeraPipe) equals the unsliced run: same loss and gradients on every
rank, for random non-uniform slicings (including length-1 slices), at PP=1, PP=2 and TP=2."""
import random

import pytest
import torch

from megatron.pipeline.executor import PipelineExecutor
from megatron.planner.terapipe.lowering import build_terapipe_plans
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config


def random_slicing(rng, s):
    cuts = sorted(rng.sample(range(1, s), rng.randint(1, min(5, s - 1))))
    if 1 not in cuts:
        cuts = [1] + cuts  # a length-1 slice at the start
    cuts = [0] + cuts + [s]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _grads(trainer):
    return {f"{sid}.{n}": (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for sid, st in trainer.stages.items() for n, p in st.named_parameters()}


def _sliced_vs_unsliced(rank, world, tp, pp, dtype, arch, seed, dropout=0.0):
    trainer = make_trainer(tiny_config(world=world, tp=tp, pp=pp, arch=arch, gbs=4, mbs=2, seq=16, dropout=dropout))
    if dtype == torch.float64:
        for st in trainer.stages.values():
            st.double()
    ex = PipelineExecutor(trainer.stages, trainer.executor.comm, rank_desc=f"rank {rank}")
    work = trainer.batch_source.next(1, 0)
    mbs = work.microbatches
    for st in trainer.stages.values():
        st.train()
    shapes = [(tuple(mb["tokens"].shape),) for mb in mbs]
    if dropout:
        # Slice-keyed dropout: the reference is the whole sequence as one slice (the unsliced
        # computation with the same keyed masks); the global-RNG path cannot be compared.
        ex.dropout_seed = 11
        ref_plans = build_terapipe_plans([[s[0][1]] for s in shapes], shapes, pp, trainer.cfg.model.hidden_size)
        stats_ref = ex.run(ref_plans[trainer.ps.pp_rank], mbs, 1e-2)
    else:
        stats_ref = ex.run(work.plan, mbs, 1e-2)
    ref = _grads(trainer)
    trainer.optimizer.zero_grad()
    rng = random.Random(seed)
    slicings = [random_slicing(rng, mb["tokens"].shape[1]) for mb in mbs]
    plans = build_terapipe_plans(slicings, shapes, pp, trainer.cfg.model.hidden_size)
    stats = ex.run(plans[trainer.ps.pp_rank], mbs, 1e-2)
    got = _grads(trainer)
    return {"ref_loss": stats_ref.loss_sum, "loss": stats.loss_sum, "ref": ref, "got": got,
            "slicings": slicings, "units": stats.forward_passes}


def _check(outs, atol, rtol, loss_rtol=1e-6):
    # The executor sums the per-token losses in fp32 (also for an fp64 model): loss_rtol.
    for o in outs:
        assert o["loss"] == pytest.approx(o["ref_loss"], rel=loss_rtol)
        assert o["units"] == sum(len(s) for s in o["slicings"]) * 1
        for name, g in o["ref"].items():
            assert g.abs().sum() > 0 or "bias" in name, name
            torch.testing.assert_close(o["got"][name], g, atol=atol, rtol=rtol, msg=lambda m: f"grad {name}: {m}")


def test_sliced_equals_unsliced_pp1_fp32():
    _check(run_distributed(_sliced_vs_unsliced, 1, 1, 1, torch.float32, None, 1), 1e-6, 1e-5)


def test_sliced_equals_unsliced_fp64_rope_gqa():
    arch = dict(position_embedding_type="rope", num_query_groups=2)
    _check(run_distributed(_sliced_vs_unsliced, 1, 1, 1, torch.float64, arch, 3), 1e-12, 1e-10)


def test_sliced_equals_unsliced_pp2():
    _check(run_distributed(_sliced_vs_unsliced, 2, 1, 2, torch.float32, None, 4), 1e-6, 1e-5)


def test_sliced_equals_one_slice_with_keyed_dropout():
    outs = run_distributed(_sliced_vs_unsliced, 1, 1, 1, torch.float64, None, 6, dropout=0.3)
    _check(outs, 1e-12, 1e-10)
    plain = run_distributed(_sliced_vs_unsliced, 1, 1, 1, torch.float64, None, 6)
    assert abs(outs[0]["loss"] - plain[0]["loss"]) > 1e-3  # the masks really drop something


def test_keyed_masks_do_not_depend_on_slicing():
    from megatron.models.sliced_attention import keep_mask
    full = keep_mask(5, 2, [torch.arange(0, 40), torch.arange(3), torch.arange(8)], 0.25, "cpu")
    part = keep_mask(5, 2, [torch.arange(13, 29), torch.arange(3), torch.arange(8)], 0.25, "cpu")
    assert torch.equal(full[13:29], part)
    assert 0.2 < 1 - full.float().mean() < 0.3
    assert not torch.equal(full, keep_mask(6, 2, [torch.arange(0, 40), torch.arange(3), torch.arange(8)], 0.25, "cpu"))


@pytest.mark.slow  # test_terapipe_training.py covers TP=2 against the single-process run
def test_sliced_equals_unsliced_tp2():
    _check(run_distributed(_sliced_vs_unsliced, 2, 2, 1, torch.float32, None, 5), 1e-6, 1e-5)
