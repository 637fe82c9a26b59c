"""The CP memory model (megatron/planner/cost/cp_cost.py) against the bytes the runtime keeps
for backward (autograd's saved_tensors_hooks, megatron/profiling/cp_memory.py), per rank, CP 1
(one process), 2 and 4, both exchanges: the attention core within 5 % of
`attention_core_saved_bytes`, and the whole layer within 5 % of one process's layer on S/N
tokens (the cost model's rule: no exchanged K/V is stored). Both come out ~1/CP."""
import pytest

from megatron.profiling.cp_memory import cp_memory_rows


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_cp_memory_model_within_five_percent(dtype):
    rows = list(cp_memory_rows(dict(seq=64, batch=2, heads=2, head_size=8), dtype=dtype, timeout_s=120))
    assert [(r["cp"], r["comm"]) for r in rows] == [(1, "one_process"), (2, "all_gather"), (2, "p2p"),
                                                     (4, "all_gather"), (4, "p2p")]
    for r in rows:
        assert abs(r["core_model_error"]) <= 0.05, r
        assert abs(r["layer_model_error"]) <= 0.05, r
        # the point of CP: a rank keeps about 1/CP (the targets: <= 0.6 at CP 2, <= 0.35 at CP 4)
        assert r["core_ratio"] <= {1: 1.0, 2: 0.6, 4: 0.35}[r["cp"]], r
