"""Packed attention through torch's flash varlen kernel on CUDA: the host-side segment
description it needs (checked on CPU), the dispatch rule, and (on a GPU) equality with the
eager reference."""
import pytest
import torch

from megatron.fused_kernels import ops
from megatron.models.packed_attention import host_segments, packed_segments


def test_host_segments_match_the_kernel_description():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 2, 2, 0]])
    cu, longest = host_segments(seg)
    assert cu.tolist() == ops.cu_seqlens_from_segment_ids(seg).tolist() == [0, 3, 5, 6, 7, 8, 13, 14]
    assert longest == 5 == ops.max_seqlen(cu)


def test_dispatch_only_on_cuda_half_precision_without_dropout():
    x = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert not ops.use_torch_varlen(x, 0.0)  # CPU: the C++ kernel stays the CPU path
    if torch.cuda.is_available() and ops.torch_varlen_attn() is not None:
        assert ops.use_torch_varlen(x.cuda(), 0.0)
        assert not ops.use_torch_varlen(x.cuda(), 0.1) and not ops.use_torch_varlen(x.cuda().float(), 0.0)


def test_precomputed_segments_are_used_as_given():
    class Cfg:
        masked_softmax_fusion = True
        attention_dropout = 0.0
    seg = torch.tensor([[1, 1, 2, 2]])
    cu, longest = host_segments(seg)
    x = torch.zeros(4, 1, 8)
    packed = packed_segments(Cfg(), seg, x, True, cu, longest)
    if not ops.use_fused(x):
        pytest.skip("no fused CPU kernel built here")
    assert packed.cu_seqlens.tolist() == [0, 2, 4] and packed.max_seqlen == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or ops.torch_varlen_attn() is None,
                    reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_matches_the_reference_on_cuda(causal):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 17, 18, 40])
    q, k, v = (torch.randn(40, 4, 64, generator=g) for _ in range(3))
    ref = ops.varlen_attention_reference(q, k, v, cu, cu, causal, 0.125)
    out = ops.varlen_attention(*(t.cuda().bfloat16() for t in (q, k, v)), cu.cuda(), causal=causal, scale=0.125,
                               max_seqlen_q=22)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
