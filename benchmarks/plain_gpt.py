"""A plain PyTorch GPT (no planner, no executor, no parallel layers): the baseline the
benchmarks time our trainer against, in the same process on the same micro-batches.

It is the same architecture as `megatron.models.gpt` for the options the benchmarks use:
GPT-2 style (learned positions, LayerNorm, GeLU-tanh MLP, biases) or Llama-like (RoPE,
RMSNorm, SwiGLU, grouped-query attention, no biases); tied input/output embeddings in both.
Attention is SDPA (flash / memory-efficient kernels on CUDA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rope(x, cos, sin):  # x [b, heads, s, hn]; rotate-half convention as megatron/models/rotary.py
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class PlainBlock(nn.Module):
    def __init__(self, h, heads, ffn, *, kv_heads=None, llama=False, eps=1e-5):
        super().__init__()
        kv_heads = kv_heads or heads
        bias = not llama
        norm = (lambda: nn.RMSNorm(h, eps=eps)) if llama else (lambda: nn.LayerNorm(h, eps=eps))
        self.ln1, self.ln2 = norm(), norm()
        self.heads, self.kv_heads, self.hn = heads, kv_heads, h // heads
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * self.hn, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.llama = llama
        if llama:
            self.gate = nn.Linear(h, ffn, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, ffn, bias=bias), nn.Linear(ffn, h, bias=bias)

    def forward(self, x, rope=None):  # [b, s, h]
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x))
        q, k, v = qkv.split([self.heads * self.hn, self.kv_heads * self.hn, self.kv_heads * self.hn], dim=-1)
        q, k, v = (t.view(b, s, -1, self.hn).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q, k = _rope(q, *rope), _rope(k, *rope)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        y = self.ln2(x)
        if self.llama:
            return x + self.fc2(F.silu(self.gate(y)) * self.fc1(y))
        return x + self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab, h, heads, ffn, layers, seq, *, kv_heads=None, llama=False, rotary_base=10000):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.llama = llama
        if not llama:
            self.wpe = nn.Embedding(seq, h)
        else:
            hn = h // heads
            self.register_buffer("inv_freq", 1.0 / rotary_base ** (torch.arange(0, hn, 2).float() / hn),
                                 persistent=False)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn, kv_heads=kv_heads, llama=llama)
                                    for _ in range(layers))
        self.ln_f = nn.RMSNorm(h) if llama else nn.LayerNorm(h)

    def forward(self, tokens, labels, loss_mask, denom):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens)
        rope = None
        if self.llama:
            ang = pos.float().unsqueeze(-1) * self.inv_freq
            emb = torch.cat((ang, ang), dim=-1)
            rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        else:
            x = x + self.wpe(pos).unsqueeze(0)
        for blk in self.blocks:
            x = blk(x, rope)
        logits = F.linear(self.ln_f(x), self.wte.weight).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return (loss * loss_mask.reshape(-1)).sum() / denom
