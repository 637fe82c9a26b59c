"""Megatron-Core's MoE flags: accepted with Megatron's names and defaults, and every combination
not supported yet refused at start-up in one line naming the flags (exit status 2)."""
import pytest

from megatron.cli.arguments import parse_args
from megatron.config.moe import parse_layer_freq

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "100", "--num-experts", "4"]


def _error(capsys, argv, world=4):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_megatron_defaults():
    moe = parse_args(BASE, world_size=1).model.moe
    assert (moe.num_experts, moe.router_topk, moe.layer_freq, moe.router_load_balancing_type) == (4, 2, 1, "aux_loss")
    assert (moe.aux_loss_coeff, moe.z_loss_coeff, moe.expert_capacity_factor) == (0.0, None, None)
    assert (moe.token_dispatcher_type, moe.token_drop_policy) == ("allgather", "probs")
    assert moe.expert_model_parallel_size == 1
    assert parse_args(BASE[:-2], world_size=1).model.moe is None
    assert parse_args(BASE[:-1] + ["0"], world_size=1).model.moe is None  # 0 means dense, as in Megatron


def test_full_flag_set_parses():
    cfg = parse_args(BASE + ["--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-layer-freq", "[1,0,1,0]",
                             "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64",
                             "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
                             "--moe-z-loss-coeff", "1e-3", "--moe-expert-capacity-factor", "1.5",
                             "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
                             "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
                             "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"],
                     world_size=4)
    moe = cfg.model.moe
    assert moe.layer_freq == [1, 0, 1, 0] and moe.moe_layers(4) == [True, False, True, False]
    assert moe.expert_model_parallel_size == 4 and moe.grouped_gemm and moe.pad_expert_input_to_capacity


@pytest.mark.parametrize("text,want", [("2", [True, False, True, False]), ("[0,1]*2", [False, True, False, True]),
                                       ("([0]*1+[1]*3)", [False, True, True, True])])
def test_layer_freq(text, want):
    from megatron.config.moe import moe_layer_pattern
    assert moe_layer_pattern(parse_layer_freq(text), 4) == want


@pytest.mark.parametrize("extra,world,needles", [
    (["--expert-model-parallel-size", "3"], 3, ["--num-experts (4)", "--expert-model-parallel-size (3)"]),
    (["--expert-model-parallel-size", "4"], 2, ["--expert-model-parallel-size (4)", "pipeline stage"]),
    (["--expert-tensor-parallel-size", "2"], 2, ["--expert-tensor-parallel-size 2"]),
    (["--tensor-model-parallel-size", "2"], 2, ["--sequence-parallel"]),
    # the torch format gathers the sharded optimizer state over DP, whose ranks hold other experts
    (["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--save", "{tmp}/ckpt"], 2,
     ["--use-distributed-optimizer", "--ckpt-format torch_dist"]),
    (["--expert-model-parallel-size", "2", "--overlap-grad-reduce"], 2, ["--overlap-grad-reduce"]),
    (["--context-parallel-size", "2"], 2, ["--context-parallel-size"]),
    (["--moe-layer-freq", "[1,0]"], 1, ["--moe-layer-freq", "--num-layers is 4"]),
    (["--moe-layer-freq", "__import__('os')"], 1, ["--moe-layer-freq"]),
    (["--moe-router-topk", "1"], 1, ["--moe-router-pre-softmax"]),
    (["--moe-router-enable-expert-bias"], 1, ["--moe-router-score-function sigmoid"]),
    (["--moe-pad-expert-input-to-capacity"], 1, ["--moe-expert-capacity-factor"]),
    (["--ckpt-format", "megatron-legacy"], 1, ["--ckpt-format megatron-legacy"]),
    (["--expert-model-parallel-size", "2", "--dynapipe", "--dynapipe-packed-rows", "--data-path", "x",
      "--targets-data-path", "y", "--tokens-per-global-batch", "600", "--dynapipe-cost-model",
      "cost_models/cpu_tiny_gpt.json"], 2, ["--dynapipe-packed-rows"]),
    (["--expert-model-parallel-size", "2", "--dynapipe", "--pipeline-schedule", "zb-h1",
      "--pipeline-model-parallel-size", "2", "--data-path", "x", "--targets-data-path", "y",
      "--tokens-per-global-batch", "600", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json"], 4,
     ["--pipeline-schedule zb-h1", "--dynapipe"]),
    (["--expert-model-parallel-size", "2", "--pack-dataset", "--data-path", "x", "--targets-data-path", "y",
      "--tokens-per-global-batch", "600"], 2, ["--pack-dataset"]),
])
def test_unsupported_combinations_are_refused_in_one_line(capsys, tmp_path, extra, world, needles):
    err = _error(capsys, BASE + [a.replace("{tmp}", str(tmp_path)) for a in extra], world)
    for n in needles:
        assert n in err, err


def test_expert_parallel_needs_experts(capsys):
    assert "--num-experts" in _error(capsys, BASE[:-2] + ["--expert-model-parallel-size", "2"], 2)
