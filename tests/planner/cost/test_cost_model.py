import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel, CostModelError, Grid, Profile

ROOT = Path(__file__).resolve().parents[3]


def tiny_model():
    nan = np.nan
    enc = Grid([[1, 2, 4], [16, 32]], {
        "forward_ms": [[1.0, 2.0], [2.0, 4.0], [4.0, nan]],  # (4, 32) ran out of memory
        "backward_ms": [[2.0, 4.0], [4.0, 8.0], [8.0, nan]],
        "stored_mb": [[10.0, 20.0], [20.0, 40.0], [40.0, nan]],
        "peak_mb": [[15.0, 30.0], [30.0, 60.0], [60.0, nan]],
    })
    post = Grid([[1, 4], [16, 32]], {"forward_ms": [[0.5, 1.0], [2.0, 4.0]], "backward_ms": [[1.0, 2.0], [4.0, 8.0]]})
    dec = Grid([[1, 2], [16, 32], [8, 16]], {
        "forward_ms": np.arange(8.0).reshape(2, 2, 2) + 1, "backward_ms": np.ones((2, 2, 2))})
    prof = Profile(1, "none", {"embedding": 5.0, "encoder": 2.0}, {"encoder": enc, "postprocess": post, "decoder": dec})
    return CostModel("tiny", {"kind": "gpt"}, [prof])


def test_grid_points_and_linear_interpolation():
    cm = tiny_model()
    c = cm.layer("encoder", 1, "none", [1, 2, 3, 1], [16, 32, 16, 24])
    assert c["forward_ms"].tolist() == [1.0, 4.0, 3.0, 1.5]
    assert c["stored_mb"][2] == pytest.approx(30.0)
    d = cm.layer("decoder", 1, "none", 1.5, 24, 12)  # centre of the cube: mean of corners
    assert float(d["forward_ms"]) == pytest.approx(np.arange(8.0).mean() + 1)


def test_beyond_grid_or_unmeasured_is_infeasible_below_is_clamped():
    cm = tiny_model()
    c = cm.layer("encoder", 1, "none", [8, 1, 4, 3, 1], [16, 64, 32, 24, 8])
    assert np.isinf(c["forward_ms"][:4]).all()  # mbs past grid, seq past grid, null cell, touching null
    assert c["forward_ms"][4] == 1.0  # seq 8 clamps to 16
    assert not np.isnan(c["peak_mb"]).any()


def test_round_trip_and_errors(tmp_path):
    cm = tiny_model()
    path = tmp_path / "cm.json"
    cm.save(path)
    back = CostModel.load(path)
    q = dict(mbs=[1, 3, 4], seq=[20, 16, 32])
    for k in ("forward_ms", "stored_mb"):
        np.testing.assert_allclose(back.layer("encoder", 1, "none", **q)[k], cm.layer("encoder", 1, "none", **q)[k])
    doc = json.loads(path.read_text())
    doc["version"] = 3
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match="unsupported cost model version 3"):
        CostModel.load(path)
    with pytest.raises(CostModelError, match="does not exist"):
        CostModel.load(tmp_path / "missing.json")
    with pytest.raises(CostModelError, match="no profile for tp=2"):
        cm.layer("encoder", 2, "none", 1, 16)
    with pytest.raises(CostModelError, match="strictly increasing"):
        Grid([[2, 1]], {"forward_ms": [1, 2]})


@pytest.mark.parametrize("name", ["gpt_6.7b_a100.json", "t5_11b_a100.json"])
def test_shipped_tables(name):
    cm = CostModel.load(ROOT / "cost_models" / name)
    assert cm.tps() == [1, 2, 4, 8]
    assert "DynaPipe" in cm.meta["source"]  # attribution travels with the numbers
    for tp in cm.tps():
        assert cm.levels(tp) == ["none", "selective", "full"]
    if cm.kind == "gpt":
        # A published point (TP1, 1 x 2048, no recompute): 5.78 / 9.65 ms, 967 / 3344 MB.
        c = cm.layer("encoder", 1, "none", 1, 2048)
        assert (float(c["forward_ms"]), float(c["backward_ms"])) == (5.78, 9.65)
        assert float(c["stored_mb"]) == pytest.approx(966.55)
        # Recompute trades time for memory, as it should.
        full = cm.layer("encoder", 1, "full", 1, 2048)
        assert full["stored_mb"] < c["stored_mb"] and full["backward_ms"] > c["backward_ms"]
        assert np.isinf(cm.layer("encoder", 1, "none", 1, 16384)["forward_ms"])
    else:
        d = cm.layer("decoder", 1, "none", 2, 512, 128)
        assert np.isfinite(d["forward_ms"]) and np.isfinite(d["peak_mb"])
        assert np.isinf(cm.layer("decoder", 1, "none", 1, 4096, 4096)["forward_ms"])  # never measured


def test_conversion_keeps_median_times_and_max_memory():
    import importlib.util
    spec = importlib.util.spec_from_file_location("convert_dynapipe", Path(__file__).resolve().parents[3]
                                                  / "cost_models" / "convert_dynapipe.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    points = {(1, 8): {"forward_ms": [1.0, 1.1, 1.75], "stored_mb": [10.0, 11.0, 17.5]}}
    g = conv._grid(points, 2)
    assert float(g.values["forward_ms"][0, 0]) == 1.1  # repeats of a time: median
    assert float(g.values["stored_mb"][0, 0]) == 17.5  # of memory: never under-estimated
