"""The local experts of one EP rank: E_local MLPs held as stacked weights.

`weight1` is [E_local, F (x2 when gated: [gate; up] as Megatron's linear_fc1), H] and `weight2`
[E_local, H, F], i.e. per expert the (out, in) layout of a Linear. Each global expert is drawn
from its own key (``<layer>.mlp.experts.<global index>``), so any EP size holds exactly the
experts of EP 1. Tokens arrive sorted by local expert with `counts` (host ints) per expert.

--moe-grouped-gemm runs each of the two GEMMs for all local experts as one
`torch.nn.functional.grouped_mm` (offsets = cumulative counts); that kernel takes float32,
bfloat16 and float16, so float64 (the parity tests) and torch builds without it use the loop.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.layers import init_full

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def activation(cfg):
    if cfg.swiglu:
        return F.silu
    return {"relu": F.relu, "gelu-erf": F.gelu}.get(cfg.activation_func, _gelu_tanh)


class LocalExperts(nn.Module):
    def __init__(self, cfg, moe, *, first_expert: int, num_local: int, seed: int, key: str, out_std: float):
        super().__init__()
        ffn = moe.ffn_hidden_size or cfg.ffn_hidden_size
        self.gated = cfg.gated_mlp
        self.act = activation(cfg)
        self.ffn = ffn
        self.grouped = moe.grouped_gemm
        h = cfg.hidden_size
        fc1 = []
        for e in range(first_expert, first_expert + num_local):
            k = f"{key}.{e}.linear_fc1.weight"
            up = init_full((ffn, h), cfg.init_method_std, seed, k)
            gate = init_full((ffn, h), cfg.init_method_std, seed, k + ".gate") if self.gated else None
            fc1.append(torch.cat([gate, up]) if self.gated else up)
        self.weight1 = nn.Parameter(torch.stack(fc1))
        self.weight2 = nn.Parameter(torch.stack([init_full((h, ffn), out_std, seed, f"{key}.{e}.linear_fc2.weight")
                                                 for e in range(first_expert, first_expert + num_local)]))
        if cfg.add_bias_linear:
            self.bias1 = nn.Parameter(torch.zeros(num_local, self.weight1.shape[1]))
            self.bias2 = nn.Parameter(torch.zeros(num_local, h))
        else:
            self.bias1 = self.bias2 = None

    def _act(self, h):
        if self.gated:
            gate, up = h.split(self.ffn, dim=-1)
            return self.act(gate) * up
        return self.act(h)

    def _bias(self, b, counts: List[int], n: int):
        if b is None:
            return 0
        return torch.repeat_interleave(b, torch.tensor(counts, device=b.device), dim=0, output_size=n)

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        if self.grouped and x.dtype in _GROUPED_DTYPES and hasattr(F, "grouped_mm"):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            n = x.shape[0]
            h = F.grouped_mm(x, self.weight1.transpose(-2, -1), offs=offs) + self._bias(self.bias1, counts, n)
            out = F.grouped_mm(self._act(h).contiguous(), self.weight2.transpose(-2, -1), offs=offs)
            return out + self._bias(self.bias2, counts, n)
        # unbind once: indexing the stacked weights per expert would make every expert's backward
        # write a full-size zero gradient (E^2 work); unbind's backward stacks the E pieces once
        w1, w2 = self.weight1.unbind(0), self.weight2.unbind(0)
        b1 = [None] * len(w1) if self.bias1 is None else self.bias1.unbind(0)
        b2 = [None] * len(w1) if self.bias2 is None else self.bias2.unbind(0)
        outs = []
        for e, chunk in enumerate(x.split(counts, dim=0)):
            outs.append(F.linear(self._act(F.linear(chunk, w1[e], b1[e])), w2[e], b2[e]))
        return torch.cat(outs, dim=0) if outs else x.new_zeros((0, self.weight2.shape[1]))
