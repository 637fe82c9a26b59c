"""Autograd front-ends of the fused kernels, each with an eager PyTorch fallback.

Every function takes `fused=None` (use the extension when it is loaded and has a kernel for the
tensor's device; `True` insists and raises otherwise; `False` is the eager reference).

* `scaled_upper_triang_masked_softmax(x, scale)`: causal softmax of x * scale, x [..., s, s].
* `scaled_masked_softmax(x, mask, scale)`: x [b, np, sq, sk], mask bool [b|1, 1, sq, sk] with
  True = masked out (Megatron's convention; SDPA's is the opposite). Fully masked rows give 0.
* `bias_gelu(bias, x)`: GeLU(tanh)(x + bias).
* `bias_dropout_add(x, bias, residual, p, training, rng=None)`: residual + dropout(x + bias).
  The keep-mask is drawn exactly as `F.dropout` draws it (bernoulli on the default generator,
  the stream Megatron uses for replicated activations, identical across TP ranks); `rng="<name>"`
  draws it inside `get_rng_tracker().fork(name)` instead (for activations sharded over TP).
  Either way `tensor_parallel.checkpoint` replays it on recomputation.
* `varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)`: attention of packed
  segments, q [total_q, h, d], k/v [total_k, h, d]; segment i is rows cu[i]:cu[i+1]. Cost is
  Σ lq_i * lk_i, not (Σ l_i)². Causal masks are bottom-right aligned (lq == lk: the usual one).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron import fused_kernels


def _ops():
    return torch.ops.megatron_fused


def use_fused(t: torch.Tensor, fused: Optional[bool] = None) -> bool:
    """Whether the extension handles tensor t (CPU always once built; CUDA when built with CUDA)."""
    if fused is False:
        return False
    ok = fused_kernels.load() and (t.device.type == "cpu" or
                                   (t.device.type == "cuda" and fused_kernels.has_cuda_kernels()))
    if fused and not ok:
        raise RuntimeError(f"fused kernels requested but unavailable for {t.device} tensors: "
                           f"{fused_kernels.unavailable_reason() or 'no kernel for this device'}; "
                           "pass the --no-*-fusion flags to use the PyTorch path")
    return ok


# --------------------------------------------------------------------------------------- softmax
class _CausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        y = _ops().scaled_upper_triang_masked_softmax_forward(x, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _ops().scaled_softmax_backward(g, y, ctx.scale), None


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale):
        y = _ops().scaled_masked_softmax_forward(x, mask, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _ops().scaled_softmax_backward(g, y, ctx.scale), None, None


def masked_softmax_reference(x, mask, scale):
    """Eager reference: softmax(x * scale) over unmasked entries, zeros where a row is fully masked."""
    s = (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    y = torch.softmax(s, dim=-1)
    if mask is not None:
        y = y.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return y.to(x.dtype)


def scaled_upper_triang_masked_softmax(x, scale: float = 1.0, fused: Optional[bool] = None):
    if use_fused(x, fused):
        return _CausalSoftmax.apply(x, float(scale))
    s = x.shape[-1]
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu_(1)
    return masked_softmax_reference(x, mask, scale)


def scaled_masked_softmax(x, mask, scale: float = 1.0, fused: Optional[bool] = None):
    if use_fused(x, fused):
        return _MaskedSoftmax.apply(x, mask, float(scale))
    return masked_softmax_reference(x, mask, scale)


# ------------------------------------------------------------------------------------- bias-GeLU
class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, x):
        ctx.save_for_backward(bias, x)
        return _ops().bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, g):
        bias, x = ctx.saved_tensors
        gx = _ops().bias_gelu_backward(g, x, bias)
        return gx.reshape(-1, gx.shape[-1]).sum(0).to(bias.dtype), gx


def bias_gelu(bias, x, fused: Optional[bool] = None):
    if bias is not None and use_fused(x, fused):
        return _BiasGelu.apply(bias, x)
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


# ----------------------------------------------------------------------------- bias-dropout-add
class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, keep, p):
        ctx.save_for_backward(keep)
        ctx.p, ctx.has_bias, ctx.bias_dtype = p, bias is not None, None if bias is None else bias.dtype
        return _ops().bias_dropout_add_forward(x, bias, residual, keep, p)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        gx = g if keep is None else _ops().dropout_backward(g, keep, ctx.p)
        gb = gx.reshape(-1, gx.shape[-1]).sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return gx, gb, g, None, None


def dropout_keep_mask(x, p: float, rng: Optional[str] = None):
    """The keep-mask F.dropout(x, p) would draw (same generator call), as bool."""
    def draw():
        # Same draws as a float (or bool) mask; drawing bytes and viewing them as bool is the
        # cheapest of the three on CPU (bool bernoulli_ goes through a slower path).
        return torch.empty_like(x, dtype=torch.uint8).bernoulli_(1 - p).view(torch.bool)
    if rng is None:
        return draw()
    from megatron.core.tensor_parallel import get_rng_tracker
    with get_rng_tracker().fork(rng):
        return draw()


def bias_dropout_add(x, bias, residual, p: float, training: bool, rng: Optional[str] = None,
                     fused: Optional[bool] = None):
    drop = training and p > 0
    if use_fused(x, fused):
        keep = dropout_keep_mask(x, p, rng) if drop else None
        return _BiasDropoutAdd.apply(x, bias, residual, keep, float(p) if drop else 0.0)
    h = x if bias is None else x + bias
    if drop:
        if rng is None:
            h = F.dropout(h, p, True)
        else:
            h = h * dropout_keep_mask(h, p, rng) / (1 - p)
    return residual + h


# ------------------------------------------------------------------------ variable-length attention
class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, dropout_p, seed):
        # Autocast off inside: the kernel's own matmuls accumulate in float32 (a 16-bit autocast
        # would hand it 16-bit scores it has no code for: --bf16/--fp16 with packed rows).
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ops().varlen_attention_forward(q, k, v, cu_q, cu_k, scale, causal, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (scale, causal, dropout_p, seed)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ops().varlen_attention_backward(g, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def varlen_attention_reference(q, k, v, cu_q, cu_k, causal: bool, scale: float, dropout_p: float = 0.0):
    """One segment at a time through SDPA (the 'samples one by one' baseline)."""
    out = torch.zeros_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0:
            continue
        if lk == 0:
            pieces.append(q.new_zeros(lq, q.shape[1], q.shape[2]))
            continue
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1)
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1)
        mask = None
        if causal:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_(lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, dropout_p=dropout_p)
        if causal and lq > lk:  # queries that see no key: zeros (SDPA gives NaN)
            o = o.masked_fill(~mask.any(-1)[None, :, None], 0.0)
        pieces.append(o.transpose(0, 1))
    if pieces:
        out = torch.cat(pieces, 0)
    return out


# Self-attention segments at least this long run through SDPA (one call each, contiguous [1, h, l, d]):
# on CPU its flash kernel beats ours there (2048 tokens causal, fwd+bwd: 170 vs 223 ms; 1024: 112
# vs 126 ms for two), while ours wins on rows of many shorter samples (10 in 2048: 60 vs 83 ms).
LONG_SEGMENT = 1024


def _long_segments_via_sdpa(q, k, v, cu, causal: bool, scale: float):
    """Self-attention without dropout over segments some of which are >= LONG_SEGMENT tokens:
    those through SDPA, the others through the kernel in one call; None when none is long."""
    bounds = cu.tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    if all(b - a < LONG_SEGMENT for a, b in spans):
        return None
    pieces, short = [], []
    for a, b in spans:
        if b - a >= LONG_SEGMENT:
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
            pieces.append((a, o.squeeze(0).transpose(0, 1)))
        elif b > a:
            short.append((a, b))
    if short:
        idx = torch.cat([torch.arange(a, b, device=q.device) for a, b in short])
        cu_s = torch.tensor([0] + [b - a for a, b in short], dtype=torch.int64, device=cu.device).cumsum(0)
        out = _VarlenAttention.apply(q[idx], k[idx], v[idx], cu_s, cu_s, scale, causal, 0.0, 0)
        offset = 0
        for a, b in short:
            pieces.append((a, out[offset:offset + b - a]))
            offset += b - a
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], 0)


def torch_varlen_attn():
    """torch's own flash-attention kernel for packed segments (`torch.nn.attention.varlen`,
    CUDA only), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def use_torch_varlen(q: torch.Tensor, dropout_p: float) -> bool:
    """Packed attention goes to torch's flash kernel on CUDA in fp16/bf16 without dropout (it
    has no dropout); everything else keeps the project's kernels or the eager reference."""
    return q.is_cuda and dropout_p == 0 and q.dtype in (torch.float16, torch.bfloat16) and \
        torch_varlen_attn() is not None


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """Longest segment (a host read: pass it precomputed where the tensor lives on a GPU)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, causal: bool = True,
                     scale: Optional[float] = None, dropout_p: float = 0.0, seed: Optional[int] = None,
                     fused: Optional[bool] = None, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None):
    """With dropout_p > 0 the fused kernel derives its mask from `seed` (drawn from the current
    default generator when None: inside `get_rng_tracker().fork()` that is the TP stream, which
    `tensor_parallel.checkpoint` replays). Without dropout, self-attention segments of
    `LONG_SEGMENT` tokens or more run through SDPA (faster there). On CUDA (fp16/bf16, no
    dropout) torch's flash varlen kernel runs; `max_seqlen_q/k` spare it a device read."""
    self_attention = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if fused is not False and use_torch_varlen(q, dropout_p):
        mq = max_seqlen_q if max_seqlen_q is not None else max_seqlen(cu_seqlens_q)
        mk = max_seqlen_k if max_seqlen_k is not None else (mq if self_attention else max_seqlen(cu_seqlens_k))
        # window (-1, 0): causal, bottom-right aligned as this module's kernels
        return torch_varlen_attn()(q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), mq, mk,
                                   scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                                   enable_gqa=k.shape[1] != q.shape[1])
    if use_fused(q, fused):
        if dropout_p == 0 and self_attention and q.shape[0] >= LONG_SEGMENT:
            out = _long_segments_via_sdpa(q, k, v, cu_seqlens_q, bool(causal), scale)
            if out is not None:
                return out
        if dropout_p > 0 and seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        return _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), float(dropout_p),
                                      int(seed or 0))
    return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p)


def cu_seqlens_from_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """int64 prefix sums over the flattened [b, s] rows: a new segment starts at every row start,
    wherever the id changes, and at every padding token (id 0), so each padding token is its own
    length-1 segment attending only to itself, exactly as `packed_attention_mask` makes it."""
    seg = torch.as_tensor(segment_ids)
    if seg.dim() != 2:
        raise ValueError(f"segment_ids must be [batch, seq], got shape {tuple(seg.shape)}")
    b, s = seg.shape
    start = torch.ones_like(seg, dtype=torch.bool)
    if s > 1:
        start[:, 1:] = (seg[:, 1:] != seg[:, :-1]) | (seg[:, 1:] == 0)
    idx = torch.nonzero(start.reshape(-1), as_tuple=False).reshape(-1)
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.int64)
