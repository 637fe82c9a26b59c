"""The GPT stage on CUDA against the same stage on CPU (GPU-only; `make gpu-check` runs it).

fp32 with TF32 off on both sides, dropout 0: the losses and every parameter gradient agree to
float32 roundoff of a 2-layer model (the kernels differ: cuBLAS / SDPA's CUDA backends vs
the CPU ones). A packed batch (segment ids) takes the variable-length path; bf16 autocast on
CUDA must stay within bf16's resolution of the fp32 CPU loss."""
import copy

import pytest
import torch

from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.models.gpt import GPTStage

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (runs on a GPU box)")]


def _stage():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=128,
                      make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
    model_parallel_seed(1234, 0, 0)
    return cfg, GPTStage(cfg, ParallelState(), layer_start=0, layer_end=2, pre_process=True, post_process=True,
                         seed=1234).train()


def _batch(cfg, packed: bool):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    if packed:
        seg = torch.ones(2, cfg.seq_length, dtype=torch.long)
        seg[:, 20:] = 2
        seg[1, 50:] = 3
        batch["segment_ids"] = seg
        pos = torch.cat([torch.arange(20), torch.arange(44)]).repeat(2, 1)
        pos[1, 50:] = torch.arange(14)
        batch["position_ids"] = pos
    return batch


def _run(stage, batch, device, autocast=False):
    stage = stage.to(device)
    b = {k: v.to(device) for k, v in batch.items()}
    for p in stage.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = stage(b, [])[0].float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.detach().cpu() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_gpt_stage_on_cuda_matches_cpu(packed):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg, stage = _stage()
    batch = _batch(cfg, packed)
    gpu = copy.deepcopy(stage)
    loss_c, grads_c = _run(stage, batch, "cpu")
    loss_g, grads_g = _run(gpu, batch, "cuda")
    assert abs(loss_g - loss_c) <= 1e-5 * abs(loss_c)
    for n, gc in grads_c.items():
        torch.testing.assert_close(grads_g[n], gc, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_gpt_stage_bf16_autocast_loss_near_fp32():
    cfg, stage = _stage()
    batch = _batch(cfg, False)
    gpu = copy.deepcopy(stage)
    loss_c, _ = _run(stage, batch, "cpu")
    loss_g, grads = _run(gpu, batch, "cuda", autocast=True)
    assert abs(loss_g - loss_c) <= 2e-2 * abs(loss_c)   # bf16 keeps 8 bits of mantissa
    assert all(torch.isfinite(g).all() for g in grads.values())
