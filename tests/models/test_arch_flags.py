"""Architecture flags (--normalization RMSNorm, --swiglu, --disable-bias-linear, --init-method-std,
--untie-embeddings-and-output-weights) keep every parallel layout equal to the single-process run."""
import pytest
import torch

from megatron.cli.arguments import parse_args
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, run_layout, tiny_config
from tests.training.test_training_parity import _compare

LLAMA_LIKE = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, init_method_std=0.01,
                  position_embedding_type="rope", rotary_percent=0.5, num_query_groups=2)


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
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--mock-data", "--vocab-size", "100"]
    m = parse_args(base + ["--position-embedding-type", "rope", "--rotary-percent", "0.5", "--rotary-base", "500000",
                           "--group-query-attention", "--num-query-groups", "2"], world_size=1).model
    assert (m.position_embedding_type, m.rotary_percent, m.rotary_base, m.num_query_groups) == ("rope", 0.5, 5e5, 2)


def test_swiglu_flops_count_the_gate():
    from megatron.training.logging import gpt_flops_per_sample
    plain = tiny_config().model
    gated = tiny_config(arch=dict(swiglu=True)).model
    extra = gpt_flops_per_sample(gated, 128) - gpt_flops_per_sample(plain, 128)
    h, f, s, L = plain.hidden_size, plain.ffn_hidden_size, plain.seq_length, plain.num_layers
    assert extra == pytest.approx(3 * 2 * h * f * s * L)


def test_rope_is_relative_and_gqa_shares_key_value_heads():
    """RoPE: q.k depends only on the position difference. GQA with one group per head equals MHA."""
    from megatron.models.rotary import apply_rotary, rotary_cos_sin
    cfg = tiny_config(arch=dict(position_embedding_type="rope")).model
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, cfg.kv_channels, generator=g), torch.randn(1, 1, 1, cfg.kv_channels, generator=g)

    def score(i, j):
        ci, si = rotary_cos_sin(cfg, torch.tensor([[i]]), torch.float32)
        cj, sj = rotary_cos_sin(cfg, torch.tensor([[j]]), torch.float32)
        return float((apply_rotary(q, ci, si) * apply_rotary(k, cj, sj)).sum())
    assert score(7, 3) == pytest.approx(score(14, 10), rel=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
    names = run_distributed(_param_names, 1, dict(num_query_groups=2))[0]
    qkv = [v for n, v in names.items() if n.endswith("self_attention.query_key_value.weight")][0]
    h, hn = 32, 8  # tiny_config: hidden 32, 4 heads
    assert qkv == ((4 + 2 * 2) * hn, h)
