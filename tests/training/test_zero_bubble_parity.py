"""Zero-bubble schedules (split backward) train exactly like 1F1B: same losses, gradients and
parameters, bit for bit (the W passes accumulate each parameter's micro-batches in 1F1B's
order), and within the repository's parity bounds of the single-process run."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity
TIMEOUT = 300.0  # a loaded 2-core machine: PP4 runs 4 ranks on 2 cores


def _exact(a_outs, b_outs):
    for rank, (a, b) in enumerate(zip(a_outs, b_outs)):
        # repr: exact float equality that also equates the nan "no loss here" of non-last ranks
        assert repr((a["loss"], a["grad_norm"])) == repr((b["loss"], b["grad_norm"])), f"rank {rank}"
        assert len(a["grads"]) == len(b["grads"])
        for step, (ga, gb) in enumerate(zip(a["grads"] + [a["params"]], b["grads"] + [b["params"]])):
            assert ga.keys() == gb.keys()
            for name in ga:
                # (an fp16 overflow step holds nan gradients in both runs)
                assert torch.allclose(ga[name][0], gb[name][0], rtol=0, atol=0, equal_nan=True), \
                    f"rank {rank}, step {step}: {name} differs"


CASES = {
    "pp2_zb-h1": (2, dict(pp=2)),
    "pp4_zb-h1": (4, dict(pp=4)),
    "pp2_zb-h2": (2, dict(pp=2)),
    "pp4_zb-h2": (4, dict(pp=4)),
    "tp2_pp2_zb-h1": (4, dict(tp=2, pp=2)),
}

# What else runs inside the split: recompute (each walk replays the checkpointed segments, dropout
# masks included), sequence parallelism (its collectives run in both walks), fp16 loss scaling.
COMPOSED = {
    "pp2_full_recompute_dropout_zb-h1": (2, dict(pp=2, recompute="full", dropout=0.2)),
    "tp2_pp2_sequence_parallel_zb-h1": (4, dict(tp=2, pp=2, arch=dict(sequence_parallel=True))),
    "pp2_fp16_zb-h2": (2, dict(pp=2, fp16=True)),
}


# fp16 autocast runs float32 weights (float64 ones make a mixed-dtype layer norm): kept in float32
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.fp32) if "fp16" in n else n for n in sorted(COMPOSED)])
def test_zero_bubble_composes_and_stays_bitwise_1f1b(name):
    world, kwargs = COMPOSED[name]
    schedule = name.split("_")[-1]
    ref = run_distributed(run_layout, world, kwargs, timeout_s=TIMEOUT)
    got = run_distributed(run_layout, world, dict(kwargs, schedule=schedule), timeout_s=TIMEOUT)
    _exact(ref, got)


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_v_matches_single_process(pp):
    # The V puts the tied embedding's two uses on one rank (one weight, accumulated by two W
    # passes), so its sums run in another order than 1F1B's: parity bounds, not bit equality.
    layers = 2 * pp
    single = run_distributed(run_layout, 1, dict(layers=layers))
    got = run_distributed(run_layout, pp, dict(pp=pp, layers=layers, schedule="zb-v"), timeout_s=TIMEOUT)
    assert_parity(single, got)
    ref = run_distributed(run_layout, pp, dict(pp=pp, layers=layers), timeout_s=TIMEOUT)
    assert_parity(ref, got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_bubble_matches_1f1b_exactly(name):
    world, kwargs = CASES[name]
    schedule = name.split("_")[-1]
    ref = run_distributed(run_layout, world, kwargs, timeout_s=TIMEOUT)
    got = run_distributed(run_layout, world, dict(kwargs, schedule=schedule), timeout_s=TIMEOUT)
    _exact(ref, got)
    single = run_distributed(run_layout, 1, {})
    assert_parity(single, got)
