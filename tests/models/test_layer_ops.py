"""Operator-level recompute (Aceso's per-op sets): every set trains exactly like no recompute
(fp32, with attention and hidden dropout), and each run of flagged operators is one checkpoint
segment."""
import pytest
import torch

from megatron.config.core import ModelConfig
from megatron.core import recompute as rc
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.models import layer_ops
from megatron.models.gpt import GPTStage

SETS = [
    "enc-MLP-gelu",
    "enc-MLP-GEMM-1+enc-MLP-gelu",
    "enc-attention-core+enc-attention-dense",
    "enc-1st-layernorm+enc-attention-qkv",
    "enc-post-attention-dropout+enc-2nd-layernorm",
    "enc-post-MLP-dropout",
    "enc-attention-qkv+enc-attention-dense+enc-MLP-gelu+enc-post-MLP-dropout",  # four runs
    "selective",
    "full",
]


def _model(**kw):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=50,
                      make_vocab_size_divisible_by=8, hidden_dropout=0.2, attention_dropout=0.2, **kw)
    model_parallel_seed(3, 0, 0)
    return GPTStage(cfg, ParallelState(), layer_start=0, layer_end=2, pre_process=True, post_process=True, seed=3)


def _step(model, tokens, setting):
    """Loss and grads with every layer running `setting` as an op-level recompute set."""
    model.zero_grad()
    model.decoder.layer_recompute = [setting] * len(model.decoder.layers)
    model_parallel_seed(11, 0, 0)  # same dropout masks in every run
    (loss,) = model({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, [])
    loss.sum().backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", [{}, {"bias_gelu_fusion": False, "bias_dropout_fusion": False}],
                         ids=["fused", "unfused"])
def test_op_sets_match_no_recompute(arch):
    model = _model(**arch).train()
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(2))
    ref_loss, ref_grads = _step(model, tokens, "none")
    for setting in SETS:
        loss, grads = _step(model, tokens, setting)
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0, msg=setting)
        for a, b in zip(ref_grads, grads):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=setting)


def test_runs_become_checkpoint_segments(monkeypatch):
    model = _model().train()
    segments = []
    real = layer_ops.checkpoint

    def counting(fn, *a):
        segments.append(fn)
        return real(fn, *a)

    monkeypatch.setattr(layer_ops, "checkpoint", counting)
    tokens = torch.randint(0, 50, (2, 17))
    _step(model, tokens, SETS[6])   # four runs per layer, two layers
    assert len(segments) == 8
    segments.clear()
    with torch.no_grad():
        model({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, [])
    assert segments == []  # nothing to recompute without autograd


def test_settings_round_trip_and_reject_unknown_ops():
    assert rc.encode(rc.decode("enc-MLP-gelu+enc-MLP-GEMM-1")) == "enc-MLP-GEMM-1+enc-MLP-gelu"
    assert rc.encode(rc.LAYER_OPS) == "full" and rc.encode(()) == "none"
    assert rc.encode({"enc-attention-core"}) == "selective"
    with pytest.raises(ValueError, match="unknown operator.*enc-MLP-relu"):
        rc.decode("enc-MLP-relu")
    # Aceso's four core-attention operators are our one fused operator
    flags = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert rc.from_flags(rc.ACESO_LAYER_OPS, flags) == {"enc-attention-core"}
    assert rc.contiguous_runs([0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1]) == [(1, 3), (4, 5), (5, 6)]


def test_gated_mlp_is_one_unit():
    model = _model(swiglu=True).train()
    tokens = torch.randint(0, 50, (2, 17))
    ref_loss, _ = _step(model, tokens, "none")
    loss, _ = _step(model, tokens, "enc-MLP-GEMM-1+enc-MLP-gelu+enc-MLP-GEMM-2")
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
    with pytest.raises(ValueError, match="splits enc-MLP-GEMM-1\\+enc-MLP-gelu\\+enc-MLP-GEMM-2"):
        _step(model, tokens, "enc-MLP-gelu")
