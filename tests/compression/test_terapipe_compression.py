"""TeraPipe token slices with compressed backpropagation (--terapipe --inter-grad-comp): every
slice's gradient message is marked in the plan; lazy error propagation keys a slice's residual
by its token offset (compression.pipeline.error_key). At full rank the run equals plain
--terapipe on the same batches."""
import dataclasses
import math

import pytest

from megatron.compression.pipeline import error_key
from megatron.config.core import CompressionConfig, TeraPipeConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity

SEQ, SLICES = 16, "1,5,2,8"


def _run(rank, world, comp=None, lossless=False):
    import tests.parity_utils as pu
    from tests.compression import lossless as L
    if lossless:
        L.lossless()
    counts = L.counting()
    orig, keys = pu.tiny_config, {}

    def cfg(**k):
        c = dataclasses.replace(orig(**k), terapipe=TeraPipeConfig(enabled=True, slices=SLICES))
        return dataclasses.replace(c, compression=CompressionConfig(**comp)) if comp else c

    orig_make = pu.make_trainer

    def make(c):  # remember the trainer to read its compressor's state after training
        keys["trainer"] = orig_make(c)
        return keys["trainer"]

    pu.tiny_config, pu.make_trainer = cfg, make
    try:
        out = run_layout(rank, world, dict(seq=SEQ, pp=2, iters=3))
    finally:
        pu.tiny_config, pu.make_trainer = orig, orig_make
    comp_state = getattr(keys["trainer"].grad_compressor, "state", None)
    return dict(out, counts=counts, error_keys=set(comp_state.error) if comp_state is not None else set())


@pytest.fixture(scope="module")
def plain():
    return run_distributed(_run, 2)


def test_full_rank_compressed_slices_with_lep_equal_plain_terapipe(plain):
    outs = run_distributed(_run, 2, dict(inter_grad_comp=True, inter_grad_comp_rank=64, use_error_feedback=True), True)
    # 4 micro-batches x 3 iterations x 4 slices sent back by stage 1, every one compressed
    assert outs[1]["counts"]["pipeline"] == 4 * 3 * 4
    assert_parity(plain, outs, codec_roundings=1)


def test_lep_keys_each_slice_by_its_token_offset(plain):
    comp = dict(inter_grad_comp=True, inter_grad_comp_rank=2, use_error_feedback=True,
                lep_carry_across_iterations=True)  # keeps the last iteration's residuals to look at
    outs = run_distributed(_run, 2, comp)
    # Slices (offset, length) (0,1) (1,5) (6,2) (8,8) of [length, 2, 32] gradients: rank-2 factors
    # are smaller for all but the one-token slice (2 x 32 values vs (2 + 32) x 2), which goes raw.
    assert outs[1]["error_keys"] == {error_key(1, 0, (5, 2, 32), 1), error_key(1, 0, (2, 2, 32), 6),
                                     error_key(1, 0, (8, 2, 32), 8)}
    assert outs[0]["error_keys"] == set()  # stage 0 sends no gradient
    ref = [o for o in plain if o["is_last"]][0]["loss"]
    got = [o for o in outs if o["is_last"]][0]["loss"]
    assert all(math.isfinite(x) for x in got)
    assert got[0] == ref[0] and got[1:] != ref[1:]  # compressed updates from the first step on


def test_sliced_plans_with_compressed_gradients_validate_and_round_trip():
    """Plans carrying token_slice and compress_rank at once: the validator accepts them, catches
    a receive that disagrees with its send, and the binary format keeps both attributes."""
    from megatron.planner.passes.compression import mark_compressed_grads
    from megatron.pipeline import instructions as I
    from megatron.pipeline.validator import PlanValidationError, validate_plans
    from megatron.planner.terapipe.lowering import build_terapipe_plans
    plans = mark_compressed_grads(build_terapipe_plans([[1, 5, 2, 8]] * 2, [((2, SEQ),)] * 2, 2, 32), 2)
    validate_plans(plans)
    sends = [x for x in plans[1].instructions if isinstance(x, I.SendGradStart)]
    assert len(sends) == 8 and all(x.compress_rank == 2 and x.token_slice for x in sends)
    for p in plans:
        assert I.ExecutionPlan.deserialize(p.serialize()) == p
    bad = [plans[0], dataclasses.replace(plans[1], instructions=[
        dataclasses.replace(x, compress_rank=0) if isinstance(x, I.SendGradStart) and x.token_slice[1] == 8 else x
        for x in plans[1].instructions])]
    with pytest.raises(PlanValidationError, match="compress_rank"):
        validate_plans(bad)
