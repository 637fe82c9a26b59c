"""CPU fused kernels against eager fp32 references (outputs and gradients) and float64 gradcheck."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron import fused_kernels
from megatron.data.packing import packed_attention_mask
from megatron.fused_kernels import ops


def _compiler_present():
    import os
    import shutil
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def test_extension_builds_when_a_compiler_is_present():
    if not _compiler_present():
        pytest.skip("no C++ compiler: the fallback test covers this machine")
    assert fused_kernels.load(), fused_kernels.unavailable_reason()


pytestmark = pytest.mark.skipif(not (_compiler_present() and fused_kernels.load()),
                                reason="fused CPU extension not built (no compiler)")


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(7))
    out.backward(g)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------ softmax
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 1, 1, 1), (2, 2, 33, 33)])
def test_causal_softmax_matches_eager(shape):
    x = torch.randn(*shape) * 3
    scale = 0.7
    ref = lambda t: torch.softmax((t * scale).masked_fill(torch.ones(shape[-1], shape[-1]).triu(1).bool(),
                                                           float("-inf")), -1)
    o1, g1 = _grads(lambda t: ops.scaled_upper_triang_masked_softmax(t, scale, fused=True), x)
    o2, g2 = _grads(ref, x)
    _close(o1, o2)
    _close(g1[0], g2[0])


@pytest.mark.parametrize("mask_batch", [1, 2])
def test_masked_softmax_matches_eager_and_zeroes_fully_masked_rows(mask_batch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 9, generator=g)
    mask = torch.rand(mask_batch, 1, 5, 9, generator=g) < 0.4
    mask[0, 0, 2, :] = True  # a fully masked row
    o1, g1 = _grads(lambda t: ops.scaled_masked_softmax(t, mask, 0.5, fused=True), x)
    o2, g2 = _grads(lambda t: ops.scaled_masked_softmax(t, mask, 0.5, fused=False), x)
    _close(o1, o2)
    _close(g1[0], g2[0])
    assert torch.all(o1[:, :, 2][:, :, None].expand(2, 3, 1, 9)[0] == 0)
    assert torch.isfinite(g1[0]).all()


def test_softmax_gradcheck_float64():
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[[[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]]]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda t: ops.scaled_masked_softmax(t, mask, 0.8, fused=True), (x,))
    assert torch.autograd.gradcheck(lambda t: ops.scaled_upper_triang_masked_softmax(t, 1.3, fused=True), (x,))


# ---------------------------------------------------------------------------------- bias-GeLU
def test_bias_gelu_matches_eager_and_gradcheck():
    x, b = torch.randn(5, 3, 37) * 3, torch.randn(37)
    o1, g1 = _grads(lambda bb, t: ops.bias_gelu(bb, t, fused=True), b, x)
    o2, g2 = _grads(lambda bb, t: F.gelu(t + bb, approximate="tanh"), b, x)
    _close(o1, o2)
    _close(g1[0], g2[0], 1e-4)  # the bias gradient sums 15 rows
    _close(g1[1], g2[1])
    x64, b64 = torch.randn(3, 6, dtype=torch.float64, requires_grad=True), torch.randn(6, dtype=torch.float64,
                                                                                       requires_grad=True)
    assert torch.autograd.gradcheck(lambda bb, t: ops.bias_gelu(bb, t, fused=True), (b64, x64))


# --------------------------------------------------------------------------- bias-dropout-add
def test_bias_dropout_add_draws_the_eager_mask_and_gradcheck():
    x, b, r = torch.randn(4, 2, 24), torch.randn(24), torch.randn(4, 2, 24)
    torch.manual_seed(3)
    o1, g1 = _grads(lambda t, bb, rr: ops.bias_dropout_add(t, bb, rr, 0.3, True, fused=True), x, b, r)
    torch.manual_seed(3)
    o2, g2 = _grads(lambda t, bb, rr: rr + F.dropout(t + bb, 0.3, True), x, b, r)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    for a, c in zip(g1, g2):
        _close(a, c)
    # no dropout (eval) and no bias
    _close(ops.bias_dropout_add(x, None, r, 0.3, False, fused=True), x + r)
    keep = torch.rand(3, 5) > 0.5
    x64, b64, r64 = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((3, 5), (5,), (3, 5)))
    assert torch.autograd.gradcheck(lambda t, bb, rr: ops._BiasDropoutAdd.apply(t, bb, rr, keep, 0.4),
                                    (x64, b64, r64))


def test_bias_dropout_add_replays_under_recompute_with_tracker_rng():
    from megatron.core.tensor_parallel import checkpoint, get_rng_tracker, model_parallel_seed
    model_parallel_seed(11, 0, 0)
    x, b, r = torch.randn(6, 16, requires_grad=True), torch.randn(16, requires_grad=True), torch.randn(6, 16)
    fn = lambda t, bb: ops.bias_dropout_add(t * 2, bb, r, 0.5, True, rng="model-parallel-rng", fused=True)
    states = get_rng_tracker().get_states()
    out = checkpoint(fn, x, b)
    out.sum().backward()
    gx_ckpt = x.grad.clone()
    get_rng_tracker().set_states(states)
    x.grad = None
    out2 = fn(x, b)
    out2.sum().backward()
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(gx_ckpt, x.grad, rtol=0, atol=0)
    assert (gx_ckpt == 0).any() and (gx_ckpt != 0).any()


# ------------------------------------------------------------------- variable-length attention
def _dense_packed(q, k, v, seg):
    """Dense SDPA over [b, s] rows with the block-diagonal causal mask."""
    b, s = seg.shape
    h, d = q.shape[1], q.shape[2]
    to4 = lambda t: t.view(b, s, h, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(to4(q), to4(k), to4(v), attn_mask=packed_attention_mask(seg))
    return o.transpose(1, 2).reshape(b * s, h, d)


def test_varlen_equals_dense_block_diagonal_attention():
    # row 0: segments of 5, 1 (length-1), 3 then 2 padding tokens; row 1: a single segment
    seg = torch.tensor([[1, 1, 1, 1, 1, 2, 3, 3, 3, 0, 0], [1] * 11])
    cu = ops.cu_seqlens_from_segment_ids(seg)
    assert cu.tolist() == [0, 5, 6, 9, 10, 11, 22]
    q, k, v = (torch.randn(22, 3, 8) for _ in range(3))
    o1, g1 = _grads(lambda a, bb, c: ops.varlen_attention(a, bb, c, cu, causal=True, fused=True), q, k, v)
    o2, g2 = _grads(lambda a, bb, c: _dense_packed(a, bb, c, seg), q, k, v)
    _close(o1, o2)
    for a, c in zip(g1, g2):
        _close(a, c)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_cross_and_noncausal_match_per_segment_reference(causal):
    cu_q = torch.tensor([0, 3, 3, 4, 9])       # an empty query segment and a length-1 one
    cu_k = torch.tensor([0, 5, 7, 7, 9])       # an empty key segment; lq > lk in the last one
    q, k, v = torch.randn(9, 2, 4), torch.randn(9, 2, 4), torch.randn(9, 2, 4)
    f = lambda a, bb, c, fused: ops.varlen_attention(a, bb, c, cu_q, cu_k, causal=causal, scale=0.4, fused=fused)
    o1, g1 = _grads(lambda a, bb, c: f(a, bb, c, True), q, k, v)
    o2, g2 = _grads(lambda a, bb, c: f(a, bb, c, False), q, k, v)
    _close(o1, o2)
    for a, c in zip(g1, g2):
        _close(a, c)
    assert torch.all(o1[3] == 0)  # its key segment is empty


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_long_segments_cross_row_blocks(causal):
    """Segments longer than the kernel's 128-row blocks (causal blocks skip keys no row sees),
    lq > lk and lq < lk included, against the per-segment reference."""
    cu_q = torch.tensor([0, 300, 301, 461, 717])
    cu_k = torch.tensor([0, 300, 420, 550, 650])
    q, k, v = torch.randn(717, 2, 8), torch.randn(650, 2, 8), torch.randn(650, 2, 8)
    f = lambda a, bb, c, fused: ops.varlen_attention(a, bb, c, cu_q, cu_k, causal=causal, fused=fused)
    o1, g1 = _grads(lambda a, bb, c: f(a, bb, c, True), q, k, v)
    o2, g2 = _grads(lambda a, bb, c: f(a, bb, c, False), q, k, v)
    _close(o1, o2)
    for a, c in zip(g1, g2):
        _close(a, c)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_long_segments_run_through_sdpa_and_match(causal, monkeypatch):
    """Rows holding long samples: those go through SDPA, the short ones through the kernel; the
    result and gradients equal the per-segment reference."""
    monkeypatch.setattr(ops, "LONG_SEGMENT", 64)
    calls = []
    real = ops._VarlenAttention.apply
    monkeypatch.setattr(ops._VarlenAttention, "apply", lambda *a: calls.append(a[3].tolist()) or real(*a))
    cu = torch.tensor([0, 5, 75, 76, 150, 158])  # short, long, length-1, long, short
    q, k, v = (torch.randn(158, 2, 8) for _ in range(3))
    o1, g1 = _grads(lambda a, bb, c: ops.varlen_attention(a, bb, c, cu, causal=causal, fused=True), q, k, v)
    assert calls == [[0, 5, 6, 14]]  # the kernel saw only the short segments
    o2, g2 = _grads(lambda a, bb, c: ops.varlen_attention(a, bb, c, cu, causal=causal, fused=False), q, k, v)
    _close(o1, o2)
    for a, c in zip(g1, g2):
        _close(a, c)


def test_varlen_gradcheck_float64():
    cu_q, cu_k = torch.tensor([0, 3, 4, 6]), torch.tensor([0, 2, 4, 6])
    q, k, v = (torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (True, False):
        assert torch.autograd.gradcheck(
            lambda a, bb, c: ops.varlen_attention(a, bb, c, cu_q, cu_k, causal=causal, fused=True), (q, k, v))


def test_varlen_rejects_inconsistent_cu_seqlens():
    q = torch.randn(5, 1, 4)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        ops.varlen_attention(q, q, q, torch.tensor([0, 3]), fused=True)


def test_bfloat16_forward_close_to_fp32():
    x = torch.randn(2, 2, 16, 16)
    _close(ops.scaled_upper_triang_masked_softmax(x.bfloat16(), 1.0, fused=True).float(),
           ops.scaled_upper_triang_masked_softmax(x, 1.0, fused=False), 2e-2)
    xb, b = torch.randn(4, 32), torch.randn(32)
    _close(ops.bias_gelu(b.bfloat16(), xb.bfloat16(), fused=True).float(), F.gelu(xb + b, approximate="tanh"), 5e-2)
    cu = torch.tensor([0, 7, 16])
    q, k, v = (torch.randn(16, 2, 8) for _ in range(3))
    _close(ops.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, fused=True).float(),
           ops.varlen_attention(q, k, v, cu, fused=False), 5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_under_16bit_autocast(dtype):
    # --bf16/--fp16 training runs the packed attention inside autocast: the kernel's internal
    # matmuls must stay float32 (autocast would hand it 16-bit scores)
    cu = torch.tensor([0, 7, 16])
    q, k, v = (torch.randn(16, 2, 8, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=dtype):
        out = ops.varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu, fused=True)
    out.float().sum().backward()
    _close(out.float(), ops.varlen_attention(q, k, v, cu, fused=False), 5e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
