"""The low-rank compressor shared by pipeline and data-parallel compression."""
import subprocess
import sys

import pytest
import torch

from megatron.compression import lowrank
from megatron.compression.pipeline import PipelineGradCompressor, error_key, tensor_wire_shapes, wire_numel


@pytest.mark.parametrize("true_rank,r", [(1, 1), (3, 4), (4, 4), (2, 8)])
def test_exact_on_inputs_of_rank_at_most_r(true_rank, r):
    g = torch.Generator().manual_seed(true_rank * 10 + r)
    m = torch.randn(40, true_rank, generator=g) @ torch.randn(true_rank, 24, generator=g)
    p, q = lowrank.compress(m, lowrank.initial_q(24, r, 0, "k"))
    assert p.shape == (40, r) and q.shape == (24, r)
    torch.testing.assert_close(p.t() @ p, torch.eye(r), atol=1e-5, rtol=0)
    torch.testing.assert_close(lowrank.decompress(p, q), m, atol=1e-4, rtol=1e-4)


def test_full_rank_input_is_approximated_not_reproduced():
    m = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    p, q = lowrank.compress(m, lowrank.initial_q(24, 4, 0, "k"))
    err = (lowrank.decompress(p, q) - m).norm() / m.norm()
    assert 0.3 < err < 1.0  # a rank-4 projection of a random 40x24 matrix


def test_wire_shapes_compress_only_when_it_saves_bytes():
    assert tensor_wire_shapes((8, 2, 32), 4) == [(16, 4), (32, 4)]
    assert tensor_wire_shapes((8, 2, 32), 0) == [(8, 2, 32)]
    assert tensor_wire_shapes((2, 1, 4), 4) == [(2, 1, 4)]  # factors would be larger
    assert tensor_wire_shapes((16,), 4) == [(16,)]
    assert wire_numel([(8, 2, 32)], 4) == 16 * 4 + 32 * 4


def test_lazy_error_propagation_invariant_sum_sent_plus_residual_equals_sum_inputs():
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=3)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(6, 2, 16, generator=g) for _ in range(7)]
    sent = []
    for m in inputs:
        wire = comp.encode(1, [m], 2)
        assert [tuple(w.shape) for w in wire] == [(12, 2), (16, 2)]
        sent.append(PipelineGradCompressor.decode([m.shape], 2, wire, torch.float32)[0])
    residual = comp.state.error[error_key(1, 0, (6, 2, 16))].reshape(6, 2, 16)
    torch.testing.assert_close(sum(sent) + residual, sum(inputs), atol=1e-5, rtol=1e-5)
    # Without LEP the residual is dropped: the sum is not preserved.
    plain = PipelineGradCompressor(lazy_error_propagation=False, seed=3)
    lost = sum(PipelineGradCompressor.decode([m.shape], 2, plain.encode(1, [m], 2), torch.float32)[0]
               for m in inputs)
    assert (lost - sum(inputs)).norm() > 0.1 * sum(inputs).norm()
    assert not plain.state.error


def test_warm_start_converges_on_a_fixed_matrix():
    m = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    u, s, vh = torch.linalg.svd(m)
    best = (m - (u[:, :4] * s[:4]) @ vh[:4]).norm()
    comp = PipelineGradCompressor(lazy_error_propagation=False)
    errs = []
    for _ in range(30):
        approx = PipelineGradCompressor.decode([m.shape], 4, comp.encode(0, [m], 4), torch.float32)[0]
        errs.append((approx - m).norm())
    assert errs[-1] < errs[0]
    assert errs[-1] < 1.02 * best  # power iteration with reuse reaches the best rank-4 error


def test_initial_q_is_the_same_in_another_process():
    code = ("from megatron.compression.lowrank import initial_q; "
            "print(float(initial_q(8, 2, 5, (1, 0, 2)).sum()))")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(out) == 1
    assert float(out.pop()) == pytest.approx(float(lowrank.initial_q(8, 2, 5, (1, 0, 2)).sum()))


def test_state_round_trips_through_state_dict():
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=3)
    m = torch.randn(6, 2, 16)
    comp.encode(1, [m], 2)
    other = PipelineGradCompressor(lazy_error_propagation=True, seed=9)
    other.load_state_dict(comp.state_dict())
    m2 = torch.randn(6, 2, 16)
    a, b = comp.encode(1, [m2], 2), other.encode(1, [m2], 2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_multi_tensor_message_compresses_each_tensor_on_its_own():
    # A T5 decoder stage sends two gradients; the small one travels raw.
    g = torch.Generator().manual_seed(4)
    big = torch.randn(8, 2, 1, generator=g) @ torch.randn(1, 32, generator=g)  # rank 1: exact at r=2
    small = torch.randn(2, 1, 4, generator=g)
    comp = PipelineGradCompressor(lazy_error_propagation=False)
    wire = comp.encode(3, [big, small], 2)
    assert [tuple(w.shape) for w in wire] == [(16, 2), (32, 2), (2, 1, 4)]
    back = PipelineGradCompressor.decode([big.shape, small.shape], 2, wire, torch.float32)
    torch.testing.assert_close(back[0], big, atol=1e-5, rtol=1e-5)
    assert torch.equal(back[1], small)


def test_a_warm_start_that_lost_rank_is_restored():
    """A message whose rows are partly zero (padded positions get exactly zero gradients) leaves
    a warm start of lower rank; the next full-rank message must still be reproduced."""
    g = torch.Generator().manual_seed(5)
    state = lowrank.LowRankState(seed=3)
    padded = torch.randn(40, 16, generator=g)
    padded[5:] = 0  # 5 real tokens: Q = M^T P has rank 5
    p, q = lowrank.compress(padded, state.q_for("k", 16, 16, "cpu"))
    assert torch.linalg.matrix_rank(q) == 5
    state.q["k"] = q
    full = torch.randn(40, 16, generator=g)
    start = state.q_for("k", 16, 16, "cpu")
    assert torch.linalg.matrix_rank(start) == 16
    p2, q2 = lowrank.compress(full, start)
    torch.testing.assert_close(lowrank.decompress(p2, q2), full, atol=1e-4, rtol=1e-4)
    # without the restore, the same warm start reproduces only 5 of 16 directions
    p3, q3 = lowrank.compress(full, q)
    assert (lowrank.decompress(p3, q3) - full).norm() / full.norm() > 0.3


def test_a_full_rank_warm_start_is_used_unchanged():
    state = lowrank.LowRankState(seed=3)
    q = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    state.q["k"] = q
    assert torch.equal(state.q_for("k", 16, 4, "cpu"), q)


def test_half_precision_messages_compress_only_when_float32_factors_are_fewer_bytes():
    """A [64, 1, 32] fp16/bf16 gradient is 4 KiB; its rank-16 float32 factors are 6 KiB, so it goes
    raw; in float32 (8 KiB) the same factors save bytes. Sender, receiver and planner agree."""
    from megatron.compression.pipeline import tensor_wire_shapes, wire_dtypes
    shape = (64, 1, 32)
    assert tensor_wire_shapes(shape, 16, "float32") == [(64, 16), (32, 16)]
    for half in ("float16", "bfloat16", "torch.float16"):
        assert tensor_wire_shapes(shape, 16, half) == [shape]
    assert wire_dtypes([shape], 16, "bfloat16") == ["bfloat16"]
    assert tensor_wire_shapes(shape, 4, "float16") == [(64, 4), (32, 4)]  # 1.5 KiB of factors
    raw16 = 64 * 32 * 2
    assert lowrank.wire_bytes(64, 32, 16, raw16, raw_itemsize=2) == raw16
    assert lowrank.wire_bytes(64, 32, 16, raw16 * 2) == (64 + 32) * 16 * 4
