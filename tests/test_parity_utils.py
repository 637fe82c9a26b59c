"""The parity bounds do not depend on how a CPU sums: float64 runs held to a fixed 1e-9, float32
runs to the worst-case rounding of any summation order (tests/parity_utils.py). They still catch
a 0.01% change of the learning rate."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import RTOL_64, assert_parity, fp32_rtol, gamma, run_layout, tiny_config, tolerance_inputs


def test_gamma_is_highams_worst_case_bound():
    # gamma_n = n u / (1 - n u) bounds a length-n sum in any order (the sqrt(n) estimate the old
    # bounds used does not); in float64 it stays 1000x below RTOL_64 for sums of 4096 terms.
    assert gamma(128) == pytest.approx(128 * 2.0 ** -24 / (1 - 128 * 2.0 ** -24), rel=1e-12)
    assert gamma(4096, torch.float64) * 1000 < RTOL_64
    with pytest.raises(AssertionError, match="meaningless"):
        gamma(2 ** 23)


def test_fp32_bound_counts_the_longest_reduction_and_the_depth():
    inputs = tolerance_inputs(tiny_config())
    # gbs 8 x seq 16 tokens; ffn 128; vocab 101 padded to 104; 4 layers
    assert inputs["reduce_len"] == 128 and inputs["depth"] == 20
    assert fp32_rtol(inputs) == pytest.approx(20 * gamma(128))
    assert fp32_rtol(inputs, codec_roundings=1) == pytest.approx(21 * gamma(128))


@pytest.mark.parity  # float64 (tests/conftest.py)
def test_a_tiny_learning_rate_change_is_caught():
    ref = run_distributed(run_layout, 1, {})
    assert ref[0]["params"]["embedding.word_embeddings.weight"][0].dtype == torch.float64
    assert_parity(ref, run_distributed(run_layout, 1, {}))  # the same run again passes
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_parity(ref, run_distributed(run_layout, 1, dict(lr=1.0001e-3)))


def test_float32_and_float64_runs_are_not_compared():
    ref = run_distributed(run_layout, 1, dict(iters=1))
    torch.set_default_dtype(torch.float64)
    try:
        got = run_distributed(run_layout, 1, dict(iters=1))
    finally:
        torch.set_default_dtype(torch.float32)
    with pytest.raises(AssertionError, match="trained in torch.float64, the reference in torch.float32"):
        assert_parity(ref, got)
