"""One composition of plan passes for every builder: each system's attribute (compressed
gradient marks, the stage-layout split) survives every composition, GPT and T5."""
import dataclasses
from types import SimpleNamespace

import pytest

from megatron.pipeline import instructions as I
from megatron.planner.passes import plan_passes
from megatron.planner.schedule.static import build_static_plans
from tests.dist_harness import run_distributed

GRAD_COMM = (I.SendGradStart, I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish)
LAYOUT = ((2, 1), (1, 2))  # a TP2 stage, then a DP2 stage: 4 ranks


def _cfg(compress: bool, rank: int = 2, sp: bool = False):
    return SimpleNamespace(compression=SimpleNamespace(inter_grad_comp=compress, inter_grad_comp_rank=rank,
                                                       inter_grad_comp_epilogue_only=False),
                           model=SimpleNamespace(sequence_parallel=sp))


def _stage_plans(mbs=4):
    shapes = [((2, 16),)] * mbs
    return build_static_plans("1f1b", mbs, 2, 1, shapes, ((16, 2, 32),))


def _grad_msgs(plans):
    return [ins for p in plans for ins in p.instructions if isinstance(ins, GRAD_COMM)]


def test_no_flags_no_passes():
    assert plan_passes(_cfg(False)) is None


@pytest.mark.parametrize("sp", [False, True])
def test_marks_survive_the_layout_split(sp):
    passes = plan_passes(_cfg(True, sp=sp), LAYOUT)
    assert passes.names == ["compressed-grads", "stage-layout"]
    plans = passes(_stage_plans())
    assert len(plans) == 4  # one plan per global rank: the split ran
    msgs = _grad_msgs(plans)
    assert msgs and all(m.compress_rank == 2 for m in msgs)


def test_presplit_plans_get_only_the_marks():
    passes = plan_passes(_cfg(True), LAYOUT, presplit=True)
    assert passes.names == ["compressed-grads"]
    assert all(m.compress_rank == 2 for m in _grad_msgs(passes(_stage_plans())))


def _t5_hetero_comm_bytes(rank, world, compress):
    from datetime import timedelta

    import torch

    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.t5_builder import build_t5_trainer
    from tests.training.test_t5_parity import tiny_t5_config
    cfg = tiny_t5_config(iters=1, mbs=4, gbs=8)
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, world_size=world, stage_parallel=list(LAYOUT),
                                          pipeline_stage_layers=[1, 3], pipeline_model_parallel_size=2,
                                          tensor_model_parallel_size=2),
        compression=dataclasses.replace(cfg.compression, inter_grad_comp=compress, inter_grad_comp_rank=2,
                                        log_compression_stats=True))
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    history = build_t5_trainer(cfg, ps, torch.device("cpu")).train()
    return history[0]["comm_bytes"]


@pytest.mark.parametrize("compress", [False, True])
def test_t5_on_an_aceso_layout_keeps_compressed_backprop(compress):
    """pretrain_t5.py --aceso-config ... --inter-grad-comp used to train uncompressed: the T5
    builder replaced the compression pass with the layout pass."""
    sent = run_distributed(_t5_hetero_comm_bytes, 4, compress)[0]
    assert sent["pp_grad_raw"] > 0
    if compress:
        assert sent["pp_grad"] < sent["pp_grad_raw"]
    else:
        assert sent["pp_grad"] == sent["pp_grad_raw"]
