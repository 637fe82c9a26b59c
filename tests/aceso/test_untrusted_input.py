"""Aceso databases and configs written by someone else: a forged or hand-broken file is one
ValueError / AcesoConfigError line naming the file, never a traceback or a steered search."""
import json

import pytest

from megatron.aceso.config import load_plan
from megatron.aceso.db import OP_HEADER, OpDatabase, read_op_csv
from megatron.aceso.runtime import AcesoConfigError, load_gpt_layout

EXAMPLE = "examples/aceso/gpt_1.3b_4gpu_3stages.json"


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.pop("num_stages"), "missing field 'num_stages'"),
    (lambda d: d.update(num_stages="3"), "field 'num_stages' is str"),
    (lambda d: d.update(num_ops_in_each_stage=[1, -5, 2]), "positive integers"),
    (lambda d: d.update(model_parallel_size_of_each_op=[[0]] * 3), "one list of non-negative|must be >= 1"),
    (lambda d: d.update(data_parallel_size_of_each_op=[[1]]), "has 1 entries for 3 stages"),
])
def test_hostile_aceso_config(tmp_path, edit, needle):
    d = json.load(open(EXAMPLE))
    edit(d)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    with pytest.raises(AcesoConfigError, match=needle) as e:
        load_gpt_layout(str(path), 24, 4)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=needle):
        load_plan(str(path))


def test_aceso_config_that_is_not_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[" * 100000)
    with pytest.raises(AcesoConfigError, match="not a JSON Aceso config"):
        load_gpt_layout(str(path), 24, 4)


@pytest.mark.parametrize("value,needle", [("abc", "not a number"), ("nan", "NaN"), ("-1e9", "negative")])
def test_hostile_op_database(tmp_path, value, needle):
    row = ["encoder-attention"] + ["1.0"] * (len(OP_HEADER) - 1)
    row[1] = value
    path = tmp_path / "gpt_1_3B_mbs1_tp1_algo0.csv"
    path.write_text(",".join(OP_HEADER) + "\n" + ",".join(row) + "\n")
    with pytest.raises(ValueError, match=needle) as e:
        read_op_csv(str(path))
    assert str(path) in str(e.value)
    coll = tmp_path / "prim_gpt_1_3B_all_reduce_2gpus.csv"
    coll.write_text("size,time\n1,2,3\n")
    with pytest.raises(ValueError, match="has 3 fields, expected 2"):
        OpDatabase(str(tmp_path), "gpt", "9B")  # the collective table is read for any model
