"""Compressed backpropagation: plan marking, validation, and training parity."""
import dataclasses

import pytest
import torch

from megatron.compression.pipeline import PipelineGradCompressor
from megatron.planner.passes.compression import mark_compressed_grads
from megatron.config.core import CompressionConfig
from megatron.pipeline import instructions as I
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.schedule.static import build_static_plans
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, make_trainer, tiny_config, train_and_record

GRAD_COMM = (I.SendGradStart, I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish)


def _plans(pp=4, m=6, schedule="1f1b"):
    return build_static_plans(schedule, m, pp, 1, [((2, 16),)] * m, ((16, 2, 32),))


def _marked(plans):
    return {(type(x).__name__, x.microbatch, x.stage, x.compress_rank)
            for p in plans for x in p.instructions if isinstance(x, GRAD_COMM) and x.compress_rank}


def test_every_gradient_message_is_marked_on_both_ends_and_activations_never():
    plans = mark_compressed_grads(_plans(), 8)
    validate_plans(plans)
    for p in plans:
        for x in p.instructions:
            if isinstance(x, GRAD_COMM):
                assert x.compress_rank == 8
            elif isinstance(x, I.CommInstruction):
                assert x.compress_rank == 0
    assert mark_compressed_grads(_plans(), 0) == _plans()


def test_epilogue_only_marks_the_drain_of_each_sender():
    pp, m = 4, 6
    plans = mark_compressed_grads(_plans(pp, m), 8, epilogue_only=True)
    validate_plans(plans)
    sent = sorted((x.stage, x.microbatch) for p in plans for x in p.instructions
                  if isinstance(x, I.SendGradStart) and x.compress_rank)
    # 1F1B: rank r runs pp-r-1 warm-up forwards, so its last forward precedes backward
    # m-(pp-r-1)-1 and the drain is the last pp-r backwards (stage 0 sends nothing).
    expect = sorted((r, mb) for r in range(1, pp) for mb in range(m - (pp - r), m))
    assert sent == expect
    recv = sorted((x.stage, x.microbatch) for p in plans for x in p.instructions
                  if isinstance(x, I.RecvGradStart) and x.compress_rank)
    assert recv == expect


def test_validator_rejects_a_compressed_send_with_an_uncompressed_receive():
    plans = mark_compressed_grads(_plans(2, 3), 4)
    rank0 = plans[0]
    rank0.instructions = [dataclasses.replace(x, compress_rank=0) if isinstance(x, I.RecvGradStart) else x
                          for x in rank0.instructions]
    with pytest.raises(PlanValidationError, match="compress_rank"):
        validate_plans(plans)
    bad = _plans(2, 3)
    act = (I.SendActivationStart, I.SendActivationFinish, I.RecvActivationStart, I.RecvActivationFinish)
    for p in bad:
        p.instructions = [dataclasses.replace(x, compress_rank=4) if isinstance(x, act) else x
                          for x in p.instructions]
    with pytest.raises(PlanValidationError, match="only gradient messages"):
        validate_plans(bad)


def _cb_config(world, cb=None, **kw):
    cfg = tiny_config(world=world, pp=2, iters=2, **kw)
    if cb is not None:
        cfg.compression = CompressionConfig(**cb)
    return cfg


def _train(rank, world, cb, kw):
    out = train_and_record(make_trainer(_cb_config(world, cb, **kw)), world)
    return out["loss"], out["grads"], out["comm_bytes"]


def test_marked_but_incompressible_messages_equal_the_baseline_bit_for_bit():
    # Rank 64 factors would be larger than a 16x2x32 gradient, so every marked message
    # travels raw: the whole marked path (plans, validator, executor) must change nothing.
    base = run_distributed(_train, 2, None, {})
    marked = run_distributed(_train, 2, dict(inter_grad_comp=True, inter_grad_comp_rank=64), {})
    assert base[-1][0] == marked[-1][0]  # losses live on the last pipeline rank
    for (_, gb, _), (_, gm, bytes_m) in zip(base, marked):
        for a, b in zip(gb, gm):
            for name in a:
                assert torch.equal(a[name][0], b[name][0]), name
    assert bytes_m[0]["pp_grad"] == bytes_m[0]["pp_grad_raw"] > 0


class _BoundaryCodec:
    """Single-process reference: apply the sender's codec to the gradient that crosses the
    stage boundary (the output of the last layer of stage 0), in the same micro-batch order."""

    def __init__(self, rank, lep, seed):
        self.comp, self.rank = PipelineGradCompressor(lep, seed), rank

    def __call__(self, module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda g: PipelineGradCompressor.decode(
                [g.shape], self.rank, self.comp.encode(1, [g], self.rank), g.dtype)[0])


def _single_with_codec(rank, world, r, lep):
    t = make_trainer(tiny_config(world=1, iters=2))
    stage = t.stages[0]
    codec = _BoundaryCodec(r, lep, t.cfg.training.seed)
    stage.decoder.layers[1].register_forward_hook(codec)
    # the codec ends each iteration as the trainer's does after the pipeline
    out = train_and_record(t, 1, each_step=codec.comp.end_iteration)
    return out["loss"], out["grads"]


@pytest.mark.parametrize("lep", [False, True])
def test_compressed_pipeline_equals_single_process_with_the_same_codec(lep):
    r = 2
    (ref_loss, ref_grads), = run_distributed(_single_with_codec, 1, r, lep)
    outs = run_distributed(_train, 2, dict(inter_grad_comp=True, inter_grad_comp_rank=r,
                                           use_error_feedback=lep), {})
    losses = outs[-1][0]
    assert losses == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for step in range(2):
        got = assemble([o[1][step] for o in outs])
        ref = assemble([ref_grads[step]])
        assert set(got) == set(ref)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
    b = outs[0][2][0]
    # 4 micro-batches of a 16x2x32 gradient: rank-2 factors are (32+32)*2 values instead of 1024.
    assert b["pp_grad_raw"] == 4 * 16 * 2 * 32 * 4
    assert b["pp_grad"] == 4 * (32 + 32) * 2 * 4


def _t5(rank, world):
    from tests.training.test_t5_parity import run_t5_layout
    import megatron.training.t5_builder as t5

    # Turn compression on through the config the T5 builder reads.
    orig = t5.build_t5_trainer

    def build(cfg, ps, device):
        cfg.compression = CompressionConfig(inter_grad_comp=True, inter_grad_comp_rank=2, use_error_feedback=True)
        return orig(cfg, ps, device)

    t5.build_t5_trainer = build
    try:
        return run_t5_layout(rank, world, dict(pp=4, split=2))
    finally:
        t5.build_t5_trainer = orig


def _t5_plain(rank, world):
    from tests.training.test_t5_parity import run_t5_layout
    return run_t5_layout(rank, world, dict(pp=4, split=2))


def test_t5_pipeline_trains_with_compressed_two_tensor_gradients():
    got = [o for o in run_distributed(_t5, 4) if o["is_last"]][0]["loss"]
    ref = [o for o in run_distributed(_t5_plain, 4) if o["is_last"]][0]["loss"]
    assert all(torch.isfinite(torch.tensor(x)) for x in got)
    assert got[0] == ref[0]  # the first forward runs before any compressed gradient is used
    assert got[1:] != ref[1:]  # later steps took compressed updates
    assert abs(got[-1] - ref[-1]) < 0.05 * ref[-1]


def _dynapipe(rank, world, data, compressed):
    import tests.training.test_dynapipe_training as T
    orig = T._cfg

    def cfg(*a, **k):
        c = orig(*a, **k)
        if compressed:
            c.compression = CompressionConfig(inter_grad_comp=True, inter_grad_comp_rank=2, use_error_feedback=True)
        return c

    T._cfg = cfg
    try:
        return T._train(rank, world, "gpt", data, "dynapipe", 2)
    finally:
        T._cfg = orig


def test_dynapipe_plans_carry_compressed_gradients(tmp_path):
    import numpy as np
    from tests.training.test_dynapipe_training import VOCAB, _write
    rng = np.random.RandomState(0)
    lin = np.clip(rng.lognormal(2.6, 0.8, 200).astype(int), 2, 60)
    lout = np.clip(rng.lognormal(1.8, 0.7, 200).astype(int), 1, 30)
    _write(str(tmp_path / "in"), [rng.randint(0, VOCAB, k) for k in lin])
    _write(str(tmp_path / "out"), [rng.randint(0, VOCAB, k) for k in lout])
    data = (str(tmp_path / "in"), str(tmp_path / "out"))
    plain = [o for o in run_distributed(_dynapipe, 2, data, False) if o["is_last"]][0]["loss"]
    comp = [o for o in run_distributed(_dynapipe, 2, data, True) if o["is_last"]][0]["loss"]
    assert comp[0] == plain[0] and comp[1] != plain[1]
