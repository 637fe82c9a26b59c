"""The memory model of the zero-bubble weight pass against what the executor's weight store
really keeps (unique saved storages + captured gradients), per row, within 5 %; and the store
keeps less than the whole graph the executor kept before."""
from pathlib import Path

import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.cost.wpass_memory import layer_wstore_bytes
from megatron.profiling.memory_rows import zb_rows
CM = Path(__file__).resolve().parents[3] / "cost_models"


def _cm():
    return CostModel.load(CM / "cpu_tiny_gpt.json")


@pytest.mark.parametrize("shape", [(1, 32), (2, 64), (4, 96)])
def test_weight_store_model_within_5_percent_per_row(shape):
    rows = list(zb_rows(_cm(), shapes=(shape,), layers=2, time_iters=1))
    assert {r["role"] for r in rows} == {"middle", "last"}
    for r in rows:
        assert abs(r["error"]) <= 0.05, r
        # what W keeps is less than the whole graph plus the captured gradients kept before
        assert r["measured_bytes"] < r["kept_graph_bytes"], r


def _measured_layer(ps, sp=False, seq=32, mbs=2, h=64, **arch):
    import torch

    from megatron.config.core import ModelConfig
    from megatron.models.gpt import GPTStage
    from megatron.profiling.profiler import _seeded
    from megatron.profiling.weight_pass import measure_split
    cfg = ModelConfig(model_type="gpt", num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=4 * h,
                      vocab_size=256, max_position_embeddings=seq, seq_length=seq, hidden_dropout=0.1,
                      attention_dropout=0.1, sequence_parallel=sp, **arch)
    with _seeded(1, ps.tp_rank, "cpu"):
        st = GPTStage(cfg, ps, layer_start=0, layer_end=1, pre_process=False, post_process=False, seed=1)
        local = seq // ps.tp_size if sp else seq
        return measure_split(st, lambda: ({}, [torch.randn(local, mbs, h)]), torch.device("cpu"), iters=1,
                             warmup=0)["wstore_bytes"]


ARCH = {  # model flags -> the formula's terms (kv channels 16, 4 heads)
    "swiglu": (dict(swiglu=True), dict(gated=True)),
    "rmsnorm": (dict(normalization="RMSNorm"), dict(stats=0.0)),
    "gqa": (dict(num_query_groups=1), dict(qkv=64 + 2 * 16)),
    "no_bias": (dict(add_bias_linear=False), dict(bias=False)),
}


@pytest.mark.parametrize("name", sorted(ARCH))
def test_layer_formula_per_architecture(name):
    from megatron.core.parallel_state import ParallelState
    flags, terms = ARCH[name]
    got = _measured_layer(ParallelState(), **flags)
    pred = float(layer_wstore_bytes(64, 64, 4, **terms))
    assert abs(pred / got - 1) <= 0.05, (got, pred)


def _tp_rank(rank, world, sp, fusion):
    from megatron.core.parallel_state import initialize_model_parallel
    ps = initialize_model_parallel(tp_size=2)
    return _measured_layer(ps, sp=sp, bias_dropout_fusion=fusion)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("fusion", [False, True])
def test_layer_formula_with_tensor_and_sequence_parallelism(sp, fusion):
    import torch

    from megatron.fused_kernels import ops
    from tests.dist_harness import run_distributed
    got = run_distributed(_tp_rank, 2, sp, fusion, timeout_s=120)
    fused = fusion and ops.use_fused(torch.zeros(1))  # the kernels may be unbuilt or switched off
    pred = float(layer_wstore_bytes(64, 64, 4, tp=2, sp=sp, fused_bias_dropout=fused))
    for g in got:
        assert abs(pred / g - 1) <= 0.05, (g, pred)
