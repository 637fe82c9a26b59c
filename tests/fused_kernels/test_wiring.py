"""The fused paths inside the GPT model: fusion on == fusion off (fp32), switches, RNG replay."""
import numpy as np
import pytest
import torch

from megatron import fused_kernels
from megatron.cli.arguments import parse_args
from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron.data.packing import pack_samples
from megatron.fused_kernels import ops
from megatron.models.gpt import GPTStage
from megatron.models.packed_attention import PackedSegments, packed_segments

pytestmark = pytest.mark.skipif(not fused_kernels.load(), reason="fused CPU extension not built (no compiler)")

FUSION = ("masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion")


def _model(fused: bool, **kw):
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=48, vocab_size=50,
                make_vocab_size_divisible_by=8, hidden_dropout=0.1, attention_dropout=0.0)
    args.update(kw)
    cfg = ModelConfig(**args, **{k: fused for k in FUSION})
    return GPTStage(cfg, ParallelState(), layer_start=0, layer_end=2, pre_process=True, post_process=True, seed=3)


def _packed_batch():
    rng = np.random.RandomState(1)
    samples = [rng.randint(0, 50, n) for n in (7, 1, 12, 5, 20, 30, 9)]
    return {k: torch.from_numpy(v) for k, v in pack_samples(samples, 48).items()}


def _train_step(model, batch, seed=5, recompute="none"):
    model_parallel_seed(seed, 0, 0)
    model.train()
    model.recompute = recompute
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # (Adam would amplify 1e-9 grads to lr-sized steps)
    (losses,) = model(batch, [])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_gpt_training_step_fused_equals_unfused_fp32():
    batch = _packed_batch()
    assert batch["tokens"].shape[0] >= 2 and (batch["segment_ids"] == 0).any()  # several rows, some padding
    fused, plain = _model(True), _model(False)
    assert isinstance(packed_segments(fused.cfg, batch["segment_ids"], batch["tokens"], True), PackedSegments)
    assert fused.decoder.layers[0].mlp.dense_h_to_4h.skip_bias_add
    assert not plain.decoder.layers[0].mlp.dense_h_to_4h.skip_bias_add
    l1, g1, p1 = _train_step(fused, batch)
    l2, g2, p2 = _train_step(plain, batch)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)
        torch.testing.assert_close(p1[n], p2[n], rtol=1e-5, atol=1e-6, msg=n)


def test_varlen_attention_dropout_replays_under_full_recompute():
    """Attention dropout inside the varlen kernel takes its seed from the TP RNG tracker, so a
    fully recomputed layer sees the same mask: gradients equal the non-recomputed run."""
    batch = _packed_batch()
    model = _model(True, attention_dropout=0.3)
    l1, g1, _ = _train_step(model, batch, recompute="none")
    model = _model(True, attention_dropout=0.3)
    l2, g2, _ = _train_step(model, batch, recompute="full")
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-7, msg=n)
    l3, _, _ = _train_step(_model(True, attention_dropout=0.0), batch)
    assert not torch.equal(l1, l3)  # dropout did act


def test_varlen_dropout_keeps_expected_fraction_and_is_seeded():
    cu = torch.tensor([0, 64, 128])
    q = torch.zeros(128, 2, 4)  # uniform attention: output = mean of kept v / (1 - p)
    v = torch.ones(128, 2, 4)
    o1 = ops.varlen_attention(q, q, v, cu, causal=False, dropout_p=0.25, seed=9, fused=True)
    o2 = ops.varlen_attention(q, q, v, cu, causal=False, dropout_p=0.25, seed=9, fused=True)
    o3 = ops.varlen_attention(q, q, v, cu, causal=False, dropout_p=0.25, seed=10, fused=True)
    assert torch.equal(o1, o2) and not torch.equal(o1, o3)
    assert abs(o1.mean().item() - 1.0) < 0.03
    q64 = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    k64, v64 = (torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(
        lambda a, b, c: ops.varlen_attention(a, b, c, torch.tensor([0, 4, 6]), dropout_p=0.3, seed=4, fused=True),
        (q64, k64, v64))


def test_switches_parse_into_the_model_config():
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "50", "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data"]
    on = parse_args(base).model
    assert all(getattr(on, k) for k in FUSION)
    off = parse_args(base + ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]).model
    assert not any(getattr(off, k) for k in FUSION)
    assert packed_segments(off, torch.ones(1, 4, dtype=torch.long), torch.zeros(1), True) is None


def test_t5_training_step_fused_equals_unfused_fp32():
    """T5 layers (encoder, decoder with cross-attention) with bias-GeLU and bias-dropout-add fused,
    hidden dropout on: the same loss and gradients as the eager path."""
    import dataclasses
    from megatron.models.t5 import build_t5_stages
    from tests.models.test_t5 import _batch
    from tests.training.test_t5_parity import tiny_t5_config
    base = tiny_t5_config()
    out = []
    for fused in (True, False):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, hidden_dropout=0.1,
                                                                  **{k: fused for k in FUSION}))
        model_parallel_seed(7, 0, 0)
        (stage,) = build_t5_stages(cfg, ParallelState()).values()
        stage.train()
        flags = [m.bias_gelu_fusion for m in stage.modules() if hasattr(m, "bias_gelu_fusion")]
        assert flags and all(f == fused for f in flags)
        batch = _batch(cfg, n=3)
        (losses,) = stage(batch, [])
        loss = (losses * batch["loss_mask"]).sum()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}))
    (l1, g1), (l2, g2) = out
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)
