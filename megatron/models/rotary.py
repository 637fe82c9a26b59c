"""Rotary position embeddings (RoPE), Hugging Face / Megatron "rotate half" convention.

The first `rotary_percent` of each head's channels rotate; angles come from the batch's
position ids, so packed rows (positions restarting per sample) rotate per sample."""
from __future__ import annotations

import torch

from megatron.config.core import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.kv_channels * cfg.rotary_percent)


def rotary_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """position_ids [b, s] -> (cos, sin), each [s, b, 1, rotary_dim] (broadcast over heads)."""
    dim = rotary_dim(cfg)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                       device=position_ids.device) / dim))
    angles = position_ids.transpose(0, 1).to(torch.float32).unsqueeze(-1) * inv_freq  # [s, b, dim/2]
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, hn]: rotate the first cos.shape[-1] channels, pass the rest through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos.to(x.dtype) + _rotate_half(rot) * sin.to(x.dtype)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
