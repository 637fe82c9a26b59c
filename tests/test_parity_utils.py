"""The parity tolerances are derived, not tuned: they admit what rounding and Adam's scale
invariance can do, and nothing more (a 0.01% change of the learning rate is caught)."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import adam_param_bounds, assert_parity, grad_atol, run_layout


def test_noise_level_gradient_gets_adams_slack_and_a_healthy_one_does_not():
    # Element 0: a gradient at the rounding floor (a key bias under softmax's shift invariance);
    # Adam normalises it into an lr-sized move whose sign is the noise's. Element 1: healthy.
    g = torch.tensor([1e-9, 0.5])
    bounds, _ = adam_param_bounds([{"w": g}] * 3, {"w": torch.tensor([0.0, 0.02])}, lr=1e-3, tokens=128)
    assert bounds["w"][0] > 1e-3           # up to ~lr per step, in either run
    assert bounds["w"][1] < 2e-7           # a healthy element: 100x tighter than the old fixed 2e-5
    assert grad_atol(g, 128) == pytest.approx(16 * 2 ** -24 * 128 ** 0.5 * 0.5)


def test_a_tiny_learning_rate_change_is_caught():
    ref = run_distributed(run_layout, 1, {})
    assert_parity(ref, run_distributed(run_layout, 1, {}))  # the same run again passes
    with pytest.raises(AssertionError, match="beyond the derived bound"):
        assert_parity(ref, run_distributed(run_layout, 1, dict(lr=1.0001e-3)))
