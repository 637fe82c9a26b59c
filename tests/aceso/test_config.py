"""Aceso JSON configs: round trip, a hand-written file in the published field layout, rejects."""
import json
import os

import pytest

from megatron.aceso.config import load_plan, plan_from_dict, plan_to_dict, save_plan
from megatron.aceso.db import SHIPPED_DIR, OpDatabase
from megatron.aceso.model import PerfModel, Plan, Stage, get_model_spec


def test_round_trip(tmp_path):
    spec = get_model_spec("gpt-1.3b")
    plan = Plan(spec.key, 4, 512, [Stage(0, 79, 2, 1), Stage(79, 315, 1, 2, (0, 1) * 118)])
    path = str(tmp_path / "c.json")
    save_plan(path, plan, spec)
    back = load_plan(path, num_ops=315)
    assert back == plan
    d = json.load(open(path))
    assert d["num_gpus"] == [2, 2] and d["num_ops_in_each_stage"] == [79, 236]
    assert d["checkpoint_activations"] == [False, True]


def test_published_layout_loads_and_predicts():
    # 1 stage of 4 GPUs, then written the way Aceso's dump does (per-op lists nested per stage)
    n0, n1 = 1 + 13 * 10, 13 * 14 + 2
    d = {
        "model_name": "gpt", "model_size": "1_3B", "num_layers": 24, "seq_length": 2048,
        "global_batch_size": 512, "micro_batch_size": 2, "num_stages": 2,
        "num_gpus": [2, 2], "checkpoint_activations": [True, False],
        "resharding_stages": [False, False], "num_ops_in_each_stage": [n0, n1],
        "model_parallel_size_of_each_op": [[1] * n0, [2] * n1],
        "data_parallel_size_of_each_op": [[2] * n0, [1] * n1],
        "recompute_ops": [[1] * n0, [0] * n1],
        "algo_of_each_op": [[0] * n0, [0] * n1],
    }
    plan = plan_from_dict(d, num_ops=315)
    assert [(s.start, s.end, s.tp, s.dp) for s in plan.stages] == [(0, n0, 1, 2), (n0, 315, 2, 1)]
    spec = get_model_spec("gpt-1.3b")
    pm = PerfModel(OpDatabase(os.path.join(SHIPPED_DIR, "miniset"), "gpt", "1_3B"), spec, 12 * 1024)
    pred = pm.predict(plan)
    assert pred.num_micro_batches == 256 and pred.stages[0].recompute_ms > 0
    assert plan_to_dict(plan, spec)["recompute_ops"] == d["recompute_ops"]


def test_rejects_op_level_resharding_and_bad_counts():
    d = {"model_name": "gpt", "model_size": "1_3B", "global_batch_size": 8, "micro_batch_size": 1,
         "num_stages": 1, "num_gpus": [2], "num_ops_in_each_stage": [315],
         "model_parallel_size_of_each_op": [[1] * 100 + [2] * 215],
         "data_parallel_size_of_each_op": [[2] * 100 + [1] * 215],
         "recompute_ops": [[0] * 315]}
    with pytest.raises(ValueError, match="changes TP/DP/algo between its ops"):
        plan_from_dict(d)
    d["model_parallel_size_of_each_op"] = [[1] * 315]
    d["data_parallel_size_of_each_op"] = [[2] * 315]
    assert plan_from_dict(d, num_ops=315).stages[0].dp == 2
    with pytest.raises(ValueError, match="the model has 300"):
        plan_from_dict(d, num_ops=300)
    d["num_gpus"] = [4]
    with pytest.raises(ValueError, match="num_gpus 4"):
        plan_from_dict(d)
