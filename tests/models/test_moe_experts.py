"""The MoE layer's pieces on one process: the grouped GEMM against the per-expert loop, and the
whole layer against a direct per-token sum  y_t = sum_e p_te * expert_e(x_t)  (+ shared expert)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.config.core import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.models.moe.experts import LocalExperts
from megatron.models.moe.layer import MoELayer
from megatron.models.transformer import ParallelMLP


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm")
def test_grouped_gemm_matches_loop():
    cfg = ModelConfig(hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, swiglu=True)
    counts = [5, 0, 9, 2]  # an empty expert too
    x = torch.randn(sum(counts), 32)
    outs, grads = [], []
    for grouped in (False, True):
        ex = LocalExperts(cfg, MoEConfig(num_experts=4, grouped_gemm=grouped), first_expert=0, num_local=4, seed=3,
                          key="e", out_std=0.02)
        xi = x.clone().requires_grad_(True)
        y = ex(xi, counts)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad, ex.weight1.grad, ex.weight2.grad, ex.bias1.grad, ex.bias2.grad])
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_layer_is_the_probability_weighted_sum_of_its_experts(gated):
    torch.set_default_dtype(torch.float64)
    try:
        moe = MoEConfig(num_experts=4, router_topk=2, expert_capacity_factor=0.75, shared_expert_intermediate_size=16)
        cfg = ModelConfig(hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, swiglu=gated, moe=moe)
        layer = MoELayer(cfg, None, seed=5, key="l", out_std=0.02, layer_number=0, dense_mlp=ParallelMLP)
        x = torch.randn(6, 2, 16)
        y = layer(x)
        probs, rmap = layer.router(x.reshape(12, 16), 6, 2)
        assert int(rmap.sum()) < 12 * 2  # capacity 0.75 dropped some pairs
        ex = layer.experts
        want = torch.zeros(12, 16)
        for t in range(12):
            for e in range(4):
                if rmap[t, e]:
                    h = F.linear(x.reshape(12, 16)[t], ex.weight1[e], ex.bias1[e])
                    h = F.silu(h[:24]) * h[24:] if gated else F.gelu(h, approximate="tanh")
                    want[t] += probs[t, e] * F.linear(h, ex.weight2[e], ex.bias2[e])
        want = want.view(6, 2, 16) + layer.shared_experts(x)
        assert torch.allclose(y, want, rtol=1e-12, atol=1e-14)
    finally:
        torch.set_default_dtype(torch.float32)
