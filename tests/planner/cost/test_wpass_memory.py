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


def test_layer_formula_scales_with_tensor_parallel_sides():
    # 20 h a + 16 bytes per token at P = h, f = 4h on one TP rank (measured exactly above); TP
    # splits the QKV/FFN-in output gradients and the projection/FFN-out inputs (3P + P + 2f = 12h
    # of the 20h), sequence parallelism the norms' terms
    one = layer_wstore_bytes(1, 64, 4)
    assert one == 20 * 64 * 4 + 16
    assert layer_wstore_bytes(1, 64, 4, tp=2) == one - 6 * 64 * 4
    assert layer_wstore_bytes(1, 64, 4, tp=2, sp=True) == one - 6 * 64 * 4 - (4 * 64 * 4 + 16) / 2
