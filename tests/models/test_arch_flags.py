"""Architecture flags (--normalization RMSNorm, --swiglu, --disable-bias-linear, --init-method-std,
--untie-embeddings-and-output-weights) keep every parallel layout equal to the single-process run."""
import pytest
import torch

from megatron.arguments import parse_args
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, run_layout, tiny_config
from tests.test_training_parity import _compare

LLAMA_LIKE = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, init_method_std=0.01)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict(arch=LLAMA_LIKE, untie=True))


@pytest.mark.parametrize("world,kw", [(2, dict(tp=2)), (2, dict(pp=2)), (4, dict(tp=2, pp=2)),
                                      (2, dict(tp=2, recompute="full"))],
                         ids=["tp2", "pp2", "tp2_pp2", "tp2_full_recompute"])
def test_llama_like_layouts_match_single_process(reference, world, kw):
    _compare(reference, run_distributed(run_layout, world, dict(kw, arch=LLAMA_LIKE, untie=True)))


def _param_names(rank, world, arch):
    t = make_trainer(tiny_config(world=world, arch=arch))
    return {n: tuple(p.shape) for m in t.modules for n, p in m.named_parameters()}


def test_flags_change_the_model_as_named():
    names = run_distributed(_param_names, 1, LLAMA_LIKE)[0]
    assert not any(n.endswith(".bias") for n in names if "dense" in n or "query_key_value" in n)
    assert any("dense_h_to_4h_gate" in n for n in names)
    assert not any("layernorm.bias" in n for n in names)  # RMSNorm has a scale only
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                      "32", "--mock-data", "--vocab-size", "100", "--normalization", "RMSNorm", "--swiglu",
                      "--disable-bias-linear", "--init-method-std", "0.006"], world_size=1)
    m = cfg.model
    assert (m.normalization, m.swiglu, m.add_bias_linear, m.init_method_std) == ("RMSNorm", True, False, 0.006)


def test_swiglu_flops_count_the_gate():
    from megatron.logging_utils import gpt_flops_per_sample
    plain = tiny_config().model
    gated = tiny_config(arch=dict(swiglu=True)).model
    extra = gpt_flops_per_sample(gated, 128) - gpt_flops_per_sample(plain, 128)
    h, f, s, L = plain.hidden_size, plain.ffn_hidden_size, plain.seq_length, plain.num_layers
    assert extra == pytest.approx(3 * 2 * h * f * s * L)
