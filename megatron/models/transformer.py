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

from megatron.config import ModelConfig
from megatron.models.rotary import apply_rotary
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, checkpoint,
                                           get_rng_tracker)
from megatron.core.tensor_parallel.mappings import group_size


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


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The layer norm of --normalization (LayerNorm, or RMSNorm without mean subtraction and bias)."""
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, *, seed: int, key: str, cross: bool = False,
                 causal: bool = True, out_std: float):
        super().__init__()
        tp = group_size(tp_group)
        self.np = cfg.num_attention_heads // tp
        self.hn = cfg.kv_channels
        self.cross, self.causal = cross, causal
        self.dropout_p = cfg.attention_dropout
        proj = cfg.projection_size
        std = cfg.init_method_std
        bias = cfg.add_bias_linear
        if cross:
            self.query = ColumnParallelLinear(cfg.hidden_size, proj, tp_group, init_std=std, seed=seed, key=key + ".query",
                                              bias=bias)
            self.key_value = ColumnParallelLinear(cfg.hidden_size, 2 * proj, tp_group, init_std=std, seed=seed,
                                                  key=key + ".key_value", bias=bias)
        else:
            # Per query group: its query heads, one key head, one value head (Megatron's layout),
            # so contiguous TP slices hold whole groups. Without GQA every head is its own group.
            self.groups = cfg.query_groups // tp
            self.heads_per_group = cfg.num_attention_heads // cfg.query_groups
            qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * self.hn
            self.query_key_value = ColumnParallelLinear(cfg.hidden_size, qkv, tp_group, init_std=std,
                                                        seed=seed, key=key + ".query_key_value", bias=bias)
        self.dense = RowParallelLinear(proj, cfg.hidden_size, tp_group, init_std=out_std, seed=seed, key=key + ".dense",
                                       bias=bias)

    def _heads(self, x, n):
        s, b, _ = x.shape
        return x.view(s, b, self.np, n * self.hn)

    def core_attention(self, q, k, v, mask, bias):
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        p = self.dropout_p if self.training else 0.0
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

    def forward(self, x, mask=None, bias=None, encoder_output=None, recompute: str = "none", rotary=None):
        if self.cross:
            q = self._heads(self.query(x), 1)
            k, v = self._heads(self.key_value(encoder_output), 2).chunk(2, dim=-1)
        else:
            q, k, v = self._split_qkv(self.query_key_value(x))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if recompute == "selective" and torch.is_grad_enabled():
            ctx = checkpoint(self.core_attention, q, k, v, mask, bias)
        else:
            ctx = self.core_attention(q, k, v, mask, bias)
        return self.dense(ctx)


class ParallelMLP(nn.Module):
    """h -> ffn -> h with GeLU (tanh), or with --swiglu: silu(gate(x)) * up(x) -> h.

    The SwiGLU gate and up projections are separate column-parallel linears, so each TP rank
    holds matching slices of both for any TP size (one fused [2*ffn, h] weight split along its
    rows would pair different gate and up columns at different TP sizes)."""

    def __init__(self, cfg: ModelConfig, tp_group, *, seed: int, key: str, out_std: float):
        super().__init__()
        bias = cfg.add_bias_linear
        self.swiglu = cfg.swiglu
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp_group,
                                                  init_std=cfg.init_method_std, seed=seed, key=key + ".dense_h_to_4h",
                                                  bias=bias)
        if self.swiglu:
            self.dense_h_to_4h_gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key=key + ".dense_h_to_4h_gate", bias=bias)
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group,
                                               init_std=out_std, seed=seed, key=key + ".dense_4h_to_h", bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.dense_4h_to_h(F.silu(self.dense_h_to_4h_gate(x)) * self.dense_h_to_4h(x))
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """Pre-LN layer; `decoder=True` adds cross-attention over the encoder output (T5)."""

    def __init__(self, cfg: ModelConfig, tp_group, *, layer_number: int, num_layers_total: int, seed: int,
                 key: str, causal: bool = True, decoder: bool = False, relative_bias: Optional[nn.Module] = None):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * num_layers_total)
        self.layer_number = layer_number
        self.hidden_dropout = cfg.hidden_dropout
        self.input_layernorm = build_norm(cfg)
        self.self_attention = ParallelAttention(cfg, tp_group, seed=seed, key=key + ".self_attention",
                                                causal=causal, out_std=out_std)
        self.decoder = decoder
        if decoder:
            self.pre_cross_attn_layernorm = build_norm(cfg)
            self.inter_attention = ParallelAttention(cfg, tp_group, seed=seed, key=key + ".inter_attention",
                                                     cross=True, causal=False, out_std=out_std)
        self.post_attention_layernorm = build_norm(cfg)
        self.mlp = ParallelMLP(cfg, tp_group, seed=seed, key=key + ".mlp", out_std=out_std)
        self.relative_bias = relative_bias

    def _drop(self, x):
        return F.dropout(x, self.hidden_dropout, self.training) if self.hidden_dropout > 0 else x

    def forward(self, x, mask=None, encoder_output=None, cross_mask=None, recompute: str = "none", rotary=None):
        bias = self.relative_bias(x.shape[0], x.shape[0]) if self.relative_bias is not None else None
        x = x + self._drop(self.self_attention(self.input_layernorm(x), mask, bias, recompute=recompute,
                                               rotary=rotary))
        if self.decoder:
            x = x + self._drop(self.inter_attention(self.pre_cross_attn_layernorm(x), cross_mask,
                                                    encoder_output=encoder_output, recompute=recompute))
        return x + self._drop(self.mlp(self.post_attention_layernorm(x)))


class TransformerBlock(nn.Module):
    """A contiguous run of layers owned by one pipeline stage."""

    def __init__(self, layers: list[TransformerLayer], recompute_method: Optional[str] = None,
                 recompute_num_layers: Optional[int] = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute_method = recompute_method or "uniform"
        self.recompute_num_layers = recompute_num_layers
        self.layer_recompute: Optional[list[str]] = None  # per layer, overrides `recompute` (Aceso)

    def _full_recompute(self, i: int) -> bool:
        if self.recompute_method == "block" and self.recompute_num_layers is not None:
            return i < self.recompute_num_layers
        return True

    def forward(self, x, mask=None, encoder_output=None, cross_mask=None, recompute: str = "none", rotary=None):
        for i, layer in enumerate(self.layers):
            if self.layer_recompute is not None:
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
