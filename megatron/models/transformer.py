"""Tensor-parallel pre-LN transformer layers ([seq, batch, hidden] activations).

Attention goes through torch's scaled_dot_product_attention: causal without a mask, or an
explicit boolean mask (True = may attend) for packed sequences / padding, plus an optional
additive bias (T5 relative positions). Recomputation is chosen per forward call (`recompute`
is "none", "selective" = core attention only, or "full" = whole layer) because DynaPipe plans
pick it per iteration.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.core import ModelConfig
from megatron.models.rotary import apply_rotary
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, checkpoint,
                                           get_rng_tracker)
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.fused_kernels import ops as fused_ops
from megatron.models.layer_ops import MLP_OPS, recompute_set, run_ops
from megatron.models.cp_attention import ContextParallelSpec, cp_core_attention
from megatron.models.packed_attention import PackedSegments, varlen_core_attention


def _sdpa(q, k, v, mask, bias, causal, dropout_p):
    """q,k,v: [b, np, s, hn]. mask: bool [b|1, 1, sq, sk] (True = attend) or None."""
    attn_mask = mask
    if bias is not None:
        attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        if causal:
            sq, sk = q.shape[-2], k.shape[-2]
            tri = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            attn_mask = attn_mask.masked_fill(~tri, float("-inf"))
            causal = False
        attn_mask = attn_mask.to(q.dtype)
    elif mask is not None:
        causal = False  # the explicit mask already encodes causality
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal)


def build_norm(cfg: ModelConfig, tp_group=None) -> nn.Module:
    """The layer norm of --normalization (LayerNorm, or RMSNorm without mean subtraction and bias).

    Under sequence parallelism each TP rank normalises only its sequence chunk, so the norm's
    parameter gradients are partial sums: they are tagged for an all-reduce over TP."""
    if cfg.normalization == "RMSNorm":
        norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    else:
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    if cfg.sequence_parallel and group_size(tp_group) > 1:
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, *, seed: int, key: str, cross: bool = False,
                 causal: bool = True, out_std: float):
        super().__init__()
        tp = group_size(tp_group)
        self.np = cfg.num_attention_heads // tp
        self.head0 = group_rank(tp_group) * self.np  # global index of the first local head
        self.hn = cfg.kv_channels
        self.cross, self.causal = cross, causal
        self.dropout_p = cfg.attention_dropout
        proj = cfg.projection_size
        std = cfg.init_method_std
        bias = cfg.add_bias_linear
        if cross:
            self.query = ColumnParallelLinear(cfg.hidden_size, proj, tp_group, init_std=std, seed=seed,
                                              key=key + ".query", bias=bias)
            self.key_value = ColumnParallelLinear(cfg.hidden_size, 2 * proj, tp_group, init_std=std, seed=seed,
                                                  key=key + ".key_value", bias=bias)
        else:
            # Per query group: its query heads, one key head, one value head (Megatron's layout),
            # so contiguous TP slices hold whole groups. Without GQA every head is its own group.
            self.groups = cfg.query_groups // tp
            self.heads_per_group = cfg.num_attention_heads // cfg.query_groups
            qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * self.hn
            self.query_key_value = ColumnParallelLinear(cfg.hidden_size, qkv, tp_group, init_std=std,
                                                        seed=seed, key=key + ".query_key_value", bias=bias,
                                                        sequence_parallel=cfg.sequence_parallel)
        self.dense = RowParallelLinear(proj, cfg.hidden_size, tp_group, init_std=out_std, seed=seed, key=key + ".dense",
                                       bias=bias, sequence_parallel=cfg.sequence_parallel)

    def _heads(self, x, n):
        s, b, _ = x.shape
        return x.view(s, b, self.np, n * self.hn)

    def core_attention(self, q, k, v, mask, bias):
        p = self.dropout_p if self.training else 0.0
        if isinstance(mask, ContextParallelSpec):  # keys/values spread over the CP group
            if bias is not None:
                raise ValueError("context parallelism takes no additive attention bias (relative positions)")
            return cp_core_attention(q, k, v, mask, p, 1_000_003 + 3 * self.layer_number, self.head0)
        if isinstance(mask, PackedSegments):  # packed rows: variable-length kernel, cost Σ lᵢ²
            if bias is not None:
                raise ValueError("variable-length attention takes no additive bias; pass --no-masked-softmax-fusion")
            if p > 0:
                with get_rng_tracker().fork():
                    return varlen_core_attention(q, k, v, mask, self.causal, p)
            return varlen_core_attention(q, k, v, mask, self.causal, 0.0)
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if p > 0:
            with get_rng_tracker().fork():
                out = _sdpa(q, k, v, mask, bias, self.causal, p)
        else:
            out = _sdpa(q, k, v, mask, bias, self.causal, 0.0)
        b, np_, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)

    def _split_qkv(self, mixed):
        s, b, _ = mixed.shape
        g, hpg, hn = self.groups, self.heads_per_group, self.hn
        mixed = mixed.view(s, b, g, (hpg + 2) * hn)
        q, k, v = mixed.split([hpg * hn, hn, hn], dim=-1)
        q = q.reshape(s, b, g * hpg, hn)
        if hpg > 1:  # every query head of a group attends with the group's one key/value head
            k = k.repeat_interleave(hpg, dim=2)
            v = v.repeat_interleave(hpg, dim=2)
        return q, k, v

    def forward(self, x, mask=None, bias=None, encoder_output=None, recompute: str = "none", rotary=None,
                kv_extend=None):
        """`kv_extend(k, v, mask) -> (k, v, mask)` (token slicing, see models/sliced_attention.py)
        prepends the cached keys/values of earlier slices of the sequence."""
        if self.cross:
            q = self._heads(self.query(x), 1)
            k, v = self._heads(self.key_value(encoder_output), 2).chunk(2, dim=-1)
        else:
            q, k, v = self._split_qkv(self.query_key_value(x))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if kv_extend is not None:
            k, v, mask = kv_extend(k, v, mask)
            keyed = getattr(kv_extend, "dropout", None)
            if keyed is not None and self.training and self.dropout_p > 0:
                qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
                ctx = keyed.attention(qq, kk, vv, mask, self.dropout_p, kv_extend.site, kv_extend.offset, self.head0)
                b, np_, s, hn = ctx.shape
                return self.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn))
        if recompute == "selective" and torch.is_grad_enabled():
            ctx = checkpoint(self.core_attention, q, k, v, mask, bias)
        else:
            ctx = self.core_attention(q, k, v, mask, bias)
        return self.dense(ctx)

    def core_from_mixed(self, mixed, mask, bias, rotary=None):
        """The ``enc-attention-core`` operator of a self-attention layer: split the QKV GEMM's
        output into heads (+ rotary), attend. Its only activation input is ``mixed``."""
        q, k, v = self._split_qkv(mixed)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return self.core_attention(q, k, v, mask, bias)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


class ParallelMLP(nn.Module):
    """h -> ffn -> h with GeLU (tanh or exact erf) or ReLU (--activation-func), or gated: act(gate(x)) * up(x) -> h
    with act = SiLU (--swiglu) or the --activation-func (--gated-linear-unit; T5 v1.1's gated GeLU).

    The SwiGLU gate and up projections are separate column-parallel linears, so each TP rank
    holds matching slices of both for any TP size (one fused [2*ffn, h] weight split along its
    rows would pair different gate and up columns at different TP sizes)."""

    def __init__(self, cfg: ModelConfig, tp_group, *, seed: int, key: str, out_std: float):
        super().__init__()
        bias = cfg.add_bias_linear
        self.gated = cfg.gated_mlp  # gate projection present (SwiGLU or a gated GeLU/ReLU)
        self.act = F.silu if cfg.swiglu else {"relu": F.relu, "gelu-erf": F.gelu}.get(cfg.activation_func, _gelu_tanh)
        sp = cfg.sequence_parallel
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp_group,
                                                  init_std=cfg.init_method_std, seed=seed, key=key + ".dense_h_to_4h",
                                                  bias=bias, sequence_parallel=sp)
        if self.gated:
            self.dense_h_to_4h_gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key=key + ".dense_h_to_4h_gate", bias=bias,
                                                           sequence_parallel=sp)
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group,
                                               init_std=out_std, seed=seed, key=key + ".dense_4h_to_h", bias=bias,
                                               sequence_parallel=sp)
        # --no-bias-gelu-fusion: bias added by the linear, then GeLU; otherwise one fused kernel
        self.bias_gelu_fusion = cfg.bias_gelu_fusion and bias and not self.gated and self.act is _gelu_tanh
        self.dense_h_to_4h.skip_bias_add = self.bias_gelu_fusion

    def forward(self, x):
        if self.gated:
            if self.dense_h_to_4h.sequence_parallel:
                # Gather the sequence once for both column-parallel inputs.
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
                x = gather_from_sequence_parallel_region(x, self.dense_h_to_4h.tp_group)
                return self.dense_4h_to_h(self.act(F.linear(x, self.dense_h_to_4h_gate.weight,
                                                            self.dense_h_to_4h_gate.bias))
                                          * F.linear(x, self.dense_h_to_4h.weight, self.dense_h_to_4h.bias))
            return self.dense_4h_to_h(self.act(self.dense_h_to_4h_gate(x)) * self.dense_h_to_4h(x))
        if self.bias_gelu_fusion:
            h, b = self.dense_h_to_4h(x)
            return self.dense_4h_to_h(fused_ops.bias_gelu(b, h))
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    """Pre-LN layer; `decoder=True` adds cross-attention over the encoder output (T5)."""

    def __init__(self, cfg: ModelConfig, tp_group, *, layer_number: int, num_layers_total: int, seed: int,
                 key: str, causal: bool = True, decoder: bool = False, relative_bias: Optional[nn.Module] = None,
                 ep_group=None, ep_rank: int = 0):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * num_layers_total)
        self.layer_number = layer_number
        # Under sequence parallelism this rank's hidden states are chunk `sp_rank` of the sequence
        # (of the token slice): keyed dropout needs their absolute positions.
        self.sp_rank = group_rank(tp_group) if cfg.sequence_parallel else 0
        self.hidden_dropout = cfg.hidden_dropout
        self.input_layernorm = build_norm(cfg, tp_group)
        self.self_attention = ParallelAttention(cfg, tp_group, seed=seed, key=key + ".self_attention",
                                                causal=causal, out_std=out_std)
        self.self_attention.layer_number = layer_number  # keys its attention-dropout masks (token slices, CP)
        self.decoder = decoder
        if decoder:
            self.pre_cross_attn_layernorm = build_norm(cfg, tp_group)
            self.inter_attention = ParallelAttention(cfg, tp_group, seed=seed, key=key + ".inter_attention",
                                                     cross=True, causal=False, out_std=out_std)
        self.post_attention_layernorm = build_norm(cfg, tp_group)
        self.is_moe = cfg.moe is not None and cfg.moe.moe_layers(num_layers_total)[layer_number]
        if self.is_moe:  # mixture of experts (megatron/models/moe), per --moe-layer-freq
            from megatron.models.moe.layer import MoELayer
            self.mlp = MoELayer(cfg, tp_group, ep_group=ep_group, ep_rank=ep_rank, seed=seed, key=key + ".mlp",
                                out_std=out_std, layer_number=layer_number, dense_mlp=ParallelMLP)
        else:
            self.mlp = ParallelMLP(cfg, tp_group, seed=seed, key=key + ".mlp", out_std=out_std)
        self.relative_bias = relative_bias
        # Bias + dropout + residual in one kernel: the output linears return (y, bias) unadded.
        self.bias_dropout_fusion = cfg.bias_dropout_fusion
        for attn in (self.self_attention, getattr(self, "inter_attention", None)):
            if attn is not None:
                attn.dense.skip_bias_add = self.bias_dropout_fusion
        if not self.is_moe:
            self.mlp.dense_4h_to_h.skip_bias_add = self.bias_dropout_fusion

    def _drop(self, x, kv_cache=None, site: int = 0):
        if kv_cache is not None and kv_cache.dropout is not None and self.training and self.hidden_dropout > 0:
            if isinstance(kv_cache, ContextParallelSpec):  # a CP rank's two chunks (split again under SP)
                at = kv_cache.token_positions(x.shape[0], self.sp_rank)
            else:
                at = kv_cache.offset + self.sp_rank * x.shape[0]
            return kv_cache.dropout.hidden(x, self.hidden_dropout, 3 * self.layer_number + site + 1, at)
        return F.dropout(x, self.hidden_dropout, self.training) if self.hidden_dropout > 0 else x

    def _residual(self, x, out, kv_cache=None, site: int = 0):
        """x + dropout(out); `out` is (y, bias) with --bias-dropout-fusion (dropout mask drawn as
        F.dropout draws it, so fused and unfused runs see the same mask). Token slices draw
        keyed masks instead, so they add the bias first and take the unfused path."""
        if isinstance(out, tuple):
            y, b = out
            if kv_cache is None or kv_cache.dropout is None:
                return fused_ops.bias_dropout_add(y, b, x, self.hidden_dropout, self.training)
            out = y + b
        return x + self._drop(out, kv_cache, site)

    def forward(self, x, mask=None, encoder_output=None, cross_mask=None, recompute: str = "none", rotary=None,
                kv_cache=None):
        bias = self.relative_bias(x.shape[0], x.shape[0]) if self.relative_bias is not None else None
        kv_extend = None
        if kv_cache is not None:
            layer = self.layer_number

            def kv_extend(k, v, m):
                return kv_cache.extend(layer, k, v, m)
            kv_extend.dropout, kv_extend.offset = kv_cache.dropout, kv_cache.offset
            kv_extend.site = 1_000_003 + 3 * layer  # attention-probability dropout of this layer
            x = self._residual(x, self.self_attention(self.input_layernorm(x), mask, bias, recompute=recompute,
                                                      rotary=rotary, kv_extend=kv_extend), kv_cache, 0)
            return self._residual(x, self.mlp(self.post_attention_layernorm(x)), kv_cache, 1)
        if not self.decoder:  # a sequence of named operators, each recomputable (core/recompute.py)
            return run_ops(self.op_units(mask, bias, rotary), recompute_set(recompute), x)
        x = self._residual(x, self.self_attention(self.input_layernorm(x), mask, bias, recompute=recompute,
                                                  rotary=rotary))
        x = self._residual(x, self.inter_attention(self.pre_cross_attn_layernorm(x), cross_mask,
                                                   encoder_output=encoder_output, recompute=recompute))
        return self._residual(x, self.mlp(self.post_attention_layernorm(x)))

    def op_units(self, mask=None, bias=None, rotary=None):
        """The layer as Aceso's operator sequence (``LAYER_OPS``): [(names, fn(h, residual) ->
        (h, residual))]. ``h`` may be a (y, bias) pair where a linear leaves its bias to the
        fused epilogue that follows it. A gated MLP (SwiGLU, gated GeLU/ReLU) is one unit over the three MLP
        names: its gate and up GEMMs have no row of their own in the op tables. ReLU takes the
        "gelu" op's place (the op tables name the activation after GeLU)."""
        attn, mlp = self.self_attention, self.mlp
        # context parallelism keys dropout by token position; else the ordinary (fused) path
        keyed = mask if isinstance(mask, ContextParallelSpec) and mask.dropout is not None else None

        def ln1(h, r):
            return self.input_layernorm(h), h

        def add_at(site):
            def add(h, r):
                x = self._residual(r, h, keyed, site)
                return x, x
            return add

        units = [(("enc-1st-layernorm",), ln1),
                 (("enc-attention-qkv",), lambda h, r: (attn.query_key_value(h), r)),
                 (("enc-attention-core",), lambda h, r: (attn.core_from_mixed(h, mask, bias, rotary), r)),
                 (("enc-attention-dense",), lambda h, r: (attn.dense(h), r)),
                 (("enc-post-attention-dropout",), add_at(0)),
                 (("enc-2nd-layernorm",), lambda h, r: (self.post_attention_layernorm(h), r))]
        if self.is_moe or mlp.gated:  # gated MLP (no op rows for gate/up GEMMs) or MoE: one unit
            units.append((MLP_OPS, lambda h, r: (mlp(h), r)))
        else:  # ParallelMLP.forward's ungated path (GeLU or ReLU), one operator per step
            if mlp.bias_gelu_fusion:
                def gelu(h, r):
                    return fused_ops.bias_gelu(h[1], h[0]), r
            else:
                def gelu(h, r):
                    return mlp.act(h), r
            units += [(("enc-MLP-GEMM-1",), lambda h, r: (mlp.dense_h_to_4h(h), r)),
                      (("enc-MLP-gelu",), gelu),
                      (("enc-MLP-GEMM-2",), lambda h, r: (mlp.dense_4h_to_h(h), r))]
        units.append((("enc-post-MLP-dropout",), add_at(1)))
        return units


class TransformerBlock(nn.Module):
    """A contiguous run of layers owned by one pipeline stage."""

    def __init__(self, layers: list[TransformerLayer], recompute_method: Optional[str] = None,
                 recompute_num_layers: Optional[int] = None, sequence_parallel: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        # Sequence-parallel dropout masks must differ between TP ranks (they hold different
        # tokens): the whole block draws from the tracker's model-parallel stream.
        self.sequence_parallel = sequence_parallel
        self.recompute_method = recompute_method or "uniform"
        self.recompute_num_layers = recompute_num_layers
        self.layer_recompute: Optional[list[str]] = None  # per layer, overrides `recompute` (Aceso)

    def _full_recompute(self, i: int) -> bool:
        if self.recompute_method == "block" and self.recompute_num_layers is not None:
            return i < self.recompute_num_layers
        return True

    def forward(self, x, mask=None, encoder_output=None, cross_mask=None, recompute: str = "none", rotary=None,
                kv_cache=None):
        if self.sequence_parallel:
            with get_rng_tracker().fork():
                return self._forward(x, mask, encoder_output, cross_mask, recompute, rotary, kv_cache)
        return self._forward(x, mask, encoder_output, cross_mask, recompute, rotary, kv_cache)

    def _forward(self, x, mask, encoder_output, cross_mask, recompute, rotary, kv_cache=None):
        for i, layer in enumerate(self.layers):
            if kv_cache is not None:  # token slices: a replay reads the cache, see SequenceKVCache.extend
                mode = self.layer_recompute[i] if self.layer_recompute is not None else recompute
                full = mode == "full" and (self.layer_recompute is not None or self._full_recompute(i))
                if full and torch.is_grad_enabled():
                    x = checkpoint(lambda h, l=layer: l(h, mask, rotary=rotary, kv_cache=kv_cache), x)
                else:
                    x = layer(x, mask, encoder_output, cross_mask, recompute=mode, rotary=rotary, kv_cache=kv_cache)
            elif self.layer_recompute is not None:  # none | selective | full | '+'-joined operators
                mode = self.layer_recompute[i]
                if mode == "full" and torch.is_grad_enabled():
                    x = checkpoint(lambda h, e, l=layer: l(h, mask, e, cross_mask, rotary=rotary), x, encoder_output)
                else:
                    x = layer(x, mask, encoder_output, cross_mask, recompute=mode, rotary=rotary)
            elif recompute == "full" and self._full_recompute(i) and torch.is_grad_enabled():
                x = checkpoint(lambda h, e, l=layer: l(h, mask, e, cross_mask, rotary=rotary), x, encoder_output)
            else:
                x = layer(x, mask, encoder_output, cross_mask, recompute=recompute, rotary=rotary)
        return x
