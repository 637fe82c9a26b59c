"""The MLP activations T5 checkpoints need (--activation-func relu: original T5; --gated-linear-unit:
T5 v1.1 / Flan-T5 gated GeLU) and T5's untied LM head: the layer computes what the flags say, the
flags parse into the config, and pipelined / tensor-parallel T5 matches the single-process run."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.cli.arguments import parse_args
from megatron.config.core import ModelConfig
from tests.dist_harness import run_distributed
from tests.training.test_t5_parity import _compare, run_t5_layout


def _mlp(**fields):
    from megatron.models.transformer import ParallelMLP
    cfg = ModelConfig(hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, add_bias_linear=False, **fields)
    return ParallelMLP(cfg, None, seed=3, key="mlp", out_std=0.02)


@pytest.mark.parametrize("fields,act,gated", [
    (dict(activation_func="relu"), F.relu, False),
    (dict(gated_linear_unit=True), lambda x: F.gelu(x, approximate="tanh"), True),
    (dict(activation_func="relu", gated_linear_unit=True), F.relu, True),
    (dict(swiglu=True), F.silu, True),
    ({}, lambda x: F.gelu(x, approximate="tanh"), False)], ids=["relu", "geglu", "reglu", "swiglu", "gelu"])
def test_mlp_computes_the_named_activation(fields, act, gated):
    mlp = _mlp(**fields)
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    up = x @ mlp.dense_h_to_4h.weight.t()
    h = act(x @ mlp.dense_h_to_4h_gate.weight.t()) * up if gated else act(up)
    assert hasattr(mlp, "dense_h_to_4h_gate") == gated
    torch.testing.assert_close(mlp(x), h @ mlp.dense_4h_to_h.weight.t(), rtol=1e-6, atol=1e-6)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "100"]


def test_flags_parse_and_conflicts_name_the_flags(capsys):
    m = parse_args(BASE + ["--activation-func", "relu", "--gated-linear-unit"], world_size=1).model
    assert (m.activation_func, m.gated_linear_unit, m.gated_mlp, m.swiglu) == ("relu", True, True, False)
    t5 = parse_args(["--encoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--encoder-seq-length", "32", "--mock-data", "--vocab-size", "100", "--gated-linear-unit",
                     "--untie-embeddings-and-output-weights"], model_type="t5", world_size=1).model
    assert t5.gated_linear_unit and t5.untie_embeddings_and_output_weights
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + ["--swiglu", "--activation-func", "relu"], world_size=1)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "--swiglu" in err and "conflicts with --activation-func relu" in err, err


def test_gated_flops_count_the_gate():
    from megatron.training.logging import gpt_flops_per_sample
    plain = ModelConfig()
    gated = dataclasses.replace(plain, gated_linear_unit=True)
    h, f, s, L = plain.hidden_size, plain.ffn_hidden_size, plain.seq_length, plain.num_layers
    assert gpt_flops_per_sample(gated, 128) - gpt_flops_per_sample(plain, 128) == pytest.approx(6 * h * f * s * L)


def _run_variant(rank, world, kw):
    """run_t5_layout with the model fields `arch` replaced (an HF-T5-shaped model)."""
    import tests.training.test_t5_parity as tp
    arch, kw = kw["arch"], {k: v for k, v in kw.items() if k != "arch"}
    orig = tp.tiny_t5_config

    def cfg(**a):
        c = orig(**a)
        c.model = ModelConfig(**{**dataclasses.asdict(c.model), **arch})
        return c
    tp.tiny_t5_config = cfg
    try:
        return run_t5_layout(rank, world, kw)
    finally:
        tp.tiny_t5_config = orig


# Original T5 (ReLU) and Flan-T5 (gated GeLU, untied head) shapes: RMSNorm, no linear biases.
VARIANTS = {"relu_untied": dict(activation_func="relu", untie_embeddings_and_output_weights=True),
            "gated_gelu_untied": dict(gated_linear_unit=True, untie_embeddings_and_output_weights=True)}


@pytest.mark.parametrize("name,world,kw", [("relu_untied", 4, dict(pp=4, split=2)),
                                           ("gated_gelu_untied", 2, dict(tp=2))], ids=["pp4_split2", "tp2"])
def test_t5_variant_layouts_match_single_process(name, world, kw):
    """PP4 split 2 with an untied head: the word embedding is summed over {0, 2} only (the last
    stage's LM head is its own table). TP2: the gate projection splits like the up projection."""
    arch = dict(VARIANTS[name], normalization="RMSNorm", add_bias_linear=False)
    ref = run_distributed(_run_variant, 1, dict(arch=arch))
    outs = run_distributed(_run_variant, world, dict(kw, arch=arch))
    copies = _compare(ref, outs)
    assert not any("output_layer" in n for n in copies)  # the untied head is nobody's copy
    if kw.get("pp"):
        assert any("word_embeddings" in n for n in copies)


def test_cost_model_of_another_activation_is_refused(tmp_path, capsys):
    """A DynaPipe cost model records the MLP it was profiled with; planning a ReLU model with a
    GeLU profile is refused naming both, as for the other architecture fields."""
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = json.load(open(os.path.join(root, "cost_models", "cpu_tiny_gpt.json")))
    doc["model"].update(activation_func="gelu", gated_linear_unit=False)
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(doc))
    m = doc["model"]
    argv = ["--num-layers", "4", "--hidden-size", str(m["hidden_size"]), "--num-attention-heads",
            str(m["num_attention_heads"]), "--ffn-hidden-size", str(m["ffn_hidden_size"]), "--seq-length", "256",
            "--pipeline-model-parallel-size", "2", "--data-path", "in", "--targets-data-path", "out",
            "--tokens-per-global-batch", "1024", "--vocab-size", "100", "--dynapipe", "--dynapipe-cost-model",
            str(path)]
    parse_args(argv, world_size=2)  # the profiled architecture: accepted
    with pytest.raises(SystemExit):
        parse_args(argv + ["--activation-func", "relu"], world_size=2)
    assert "activation_func gelu vs relu" in capsys.readouterr().err
