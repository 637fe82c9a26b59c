"""Where lazy error propagation puts a residual when micro-batch shapes vary (DynaPipe) or a
micro-batch is cut into token slices (TeraPipe): `compression.pipeline.error_key`."""
import torch

from megatron.compression.pipeline import PipelineGradCompressor, error_key


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _folded(comp, stage, t, offset=0):
    """What the sender compressed for `t`: decoded message + the residual it kept (= t + the
    residual it folded in)."""
    wire = comp.encode(stage, [t], 2, offset)
    sent = PipelineGradCompressor.decode([t.shape], 2, wire, torch.float32)[0]
    kept = comp.state.error[error_key(stage, 0, t.shape, offset)].reshape(t.shape)
    return sent + kept


def test_a_residual_waits_for_the_next_microbatch_of_its_shape():
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=5)
    a1, b, a2 = _rand(16, 2, 32, seed=1), _rand(24, 1, 32, seed=2), _rand(16, 2, 32, seed=3)
    assert torch.allclose(_folded(comp, 1, a1), a1, atol=1e-5)
    e_a1 = comp.state.error[error_key(1, 0, a1.shape)].clone().reshape(a1.shape)
    assert e_a1.abs().max() > 1e-3  # rank 2 of a random 32x32 matrix: a real residual
    _folded(comp, 1, b)  # another shape in between neither takes nor overwrites a1's residual
    torch.testing.assert_close(_folded(comp, 1, a2), a2 + e_a1, atol=1e-5, rtol=1e-5)


def test_same_token_count_in_another_layout_is_another_key():
    # [32, 1] and [16, 2] are both 32 x h token matrices, but token (i, j) of one is not
    # position (i, j) of the other: no residual crosses between them.
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=5)
    x, y = _rand(16, 2, 32, seed=1), _rand(32, 1, 32, seed=2)
    _folded(comp, 1, x)
    torch.testing.assert_close(_folded(comp, 1, y), y, atol=1e-5, rtol=1e-5)
    assert len(comp.state.error) == 2


def test_token_slices_pass_residuals_to_the_same_positions_of_the_next_sequence():
    # TeraPipe order: sequence 1's slices backward (offset 8, then 0), then sequence 0's.
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=5)
    s1_hi, s1_lo = _rand(8, 2, 32, seed=1), _rand(8, 2, 32, seed=2)
    s0_hi, s0_lo = _rand(8, 2, 32, seed=3), _rand(8, 2, 32, seed=4)
    assert torch.allclose(_folded(comp, 1, s1_hi, 8), s1_hi, atol=1e-5)
    e_hi = comp.state.error[error_key(1, 0, s1_hi.shape, 8)].clone().reshape(s1_hi.shape)
    # The next slice has the same shape but starts at token 0: it must not take the residual
    # of tokens 8..15.
    torch.testing.assert_close(_folded(comp, 1, s1_lo, 0), s1_lo, atol=1e-5, rtol=1e-5)
    e_lo = comp.state.error[error_key(1, 0, s1_lo.shape, 0)].clone().reshape(s1_lo.shape)
    torch.testing.assert_close(_folded(comp, 1, s0_hi, 8), s0_hi + e_hi, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_folded(comp, 1, s0_lo, 0), s0_lo + e_lo, atol=1e-5, rtol=1e-5)


def test_carried_residuals_of_shapes_not_seen_again_are_dropped():
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=5, reset_each_iteration=False)
    a, b = _rand(16, 2, 32, seed=1), _rand(24, 1, 32, seed=2)
    comp.encode(1, [a], 2)
    comp.encode(1, [b], 2)
    comp.end_iteration()
    assert set(comp.state.error) == {error_key(1, 0, a.shape), error_key(1, 0, b.shape)}
    comp.encode(1, [a], 2)  # the next iteration sends shape a only
    comp.end_iteration()
    assert set(comp.state.error) == {error_key(1, 0, a.shape)}
    # The warm start is shared by every shape of the stage (it lives in the hidden dimension).
    assert set(comp.state.q) == {(1, 0, 2)}
