"""Zero-bubble schedules (split backward) train exactly like 1F1B: same losses, gradients and
parameters, bit for bit (the W passes accumulate each parameter's micro-batches in 1F1B's
order), and within the repository's parity bounds of the single-process run."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


def _exact(a_outs, b_outs):
    for rank, (a, b) in enumerate(zip(a_outs, b_outs)):
        # repr: exact float equality that also equates the nan "no loss here" of non-last ranks
        assert repr((a["loss"], a["grad_norm"])) == repr((b["loss"], b["grad_norm"])), f"rank {rank}"
        assert len(a["grads"]) == len(b["grads"])
        for step, (ga, gb) in enumerate(zip(a["grads"] + [a["params"]], b["grads"] + [b["params"]])):
            assert ga.keys() == gb.keys()
            for name in ga:
                assert torch.equal(ga[name][0], gb[name][0]), f"rank {rank}, step {step}: {name} differs"


CASES = {
    "pp2_zb-h1": (2, dict(pp=2)),
    "pp4_zb-h1": (4, dict(pp=4)),
    "pp2_zb-h2": (2, dict(pp=2)),
    "pp4_zb-h2": (4, dict(pp=4)),
    "tp2_pp2_zb-h1": (4, dict(tp=2, pp=2)),
}


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_v_matches_single_process(pp):
    # The V puts the tied embedding's two uses on one rank (one weight, accumulated by two W
    # passes), so its sums run in another order than 1F1B's: parity bounds, not bit equality.
    layers = 2 * pp
    single = run_distributed(run_layout, 1, dict(layers=layers))
    got = run_distributed(run_layout, pp, dict(pp=pp, layers=layers, schedule="zb-v"))
    assert_parity(single, got)
    ref = run_distributed(run_layout, pp, dict(pp=pp, layers=layers))
    assert_parity(ref, got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_bubble_matches_1f1b_exactly(name):
    world, kwargs = CASES[name]
    schedule = name.split("_")[-1]
    ref = run_distributed(run_layout, world, kwargs)
    got = run_distributed(run_layout, world, dict(kwargs, schedule=schedule))
    _exact(ref, got)
    single = run_distributed(run_layout, 1, {})
    assert_parity(single, got)
