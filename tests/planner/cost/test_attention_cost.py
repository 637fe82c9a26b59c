import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.attention_cost import AttentionCost, fit_grid, fit_report, main
from megatron.planner.cost.cost_model import CostModel, Grid, Profile

CM = Path(__file__).resolve().parents[3] / "cost_models"
C, A, BETA = 0.5, 0.002, 1e-6  # const, per token, per squared token


def synthetic(quad_mem=1e-4):
    b = np.array([1, 2, 4, 8], float)
    s = np.array([64, 128, 256, 512, 1024], float)
    B, S = np.meshgrid(b, s, indexing="ij")
    t = C + A * B * S + BETA * B * S * S
    mem = 0.1 * B * S + quad_mem * B * S * S
    enc = Grid([b, s], {"forward_ms": t, "backward_ms": 2 * t, "stored_mb": mem, "peak_mb": 1.5 * mem})
    post = Grid([b, s], {"forward_ms": A * B * S, "backward_ms": A * B * S})
    prof = Profile(1, "none", {"embedding": 1.0, "encoder": 1.0}, {"encoder": enc, "postprocess": post})
    return CostModel("synthetic", {"kind": "gpt"}, [prof])


def test_fit_recovers_an_exact_split():
    cm = synthetic()
    sp = fit_grid(cm.profile(1, "none").components["encoder"], "encoder", "forward_ms")
    assert sp.coef["const"] == pytest.approx(C, rel=1e-6)
    assert sp.coef["tokens"] == pytest.approx(A, rel=1e-6)
    assert sp.coef["quad"] == pytest.approx(BETA, rel=1e-6)
    assert sp.rel_err_max < 1e-9


def test_packed_row_prices_attention_per_document_and_memory_linear():
    cm = synthetic()
    ac = AttentionCost(cm)
    dense = cm.layer("encoder", 1, "none", 2, 1024)
    # one document per row: the dense row's time exactly
    one = ac.packed_layer("encoder", 1, "none", 2, 1024, quad=2 * 1024.0 ** 2)
    assert float(one["forward_ms"]) == pytest.approx(float(dense["forward_ms"]))
    # four documents of 256 per row: attention work sum l^2 = 4 * 256^2 per row
    four = ac.packed_layer("encoder", 1, "none", 2, 1024, quad=2 * 4 * 256.0 ** 2)
    want = C + A * 2 * 1024 + BETA * 2 * 4 * 256 ** 2
    assert float(four["forward_ms"]) == pytest.approx(want, rel=1e-6)
    assert float(four["backward_ms"]) == pytest.approx(2 * want, rel=1e-6)
    # flash/varlen kernel: no score matrix, memory linear in tokens whatever the documents
    assert float(four["stored_mb"]) == pytest.approx(0.1 * 2 * 1024, rel=1e-6)
    assert float(one["stored_mb"]) == pytest.approx(float(four["stored_mb"]))
    # past the grid stays infeasible
    assert np.isinf(ac.packed_layer("encoder", 1, "none", 16, 1024, quad=1.0)["forward_ms"])


def test_split_in_file_is_used_and_round_trips(tmp_path):
    cm = synthetic()
    cm.attention_splits[(1, "none", "encoder", "forward_ms")] = {
        "coef": {"const": 0.0, "tokens": 0.0, "quad": 2e-6}, "source": "measured"}
    path = tmp_path / "cm.json"
    cm.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 2
    assert "attention_split" in doc["profiles"][0]["components"]["encoder"]
    back = CostModel.load(path)
    ac = AttentionCost(back)
    assert ac.split(1, "none", "encoder", "forward_ms").source == "measured"
    assert ac.split(1, "none", "encoder", "backward_ms").source == "fitted"
    got = ac.packed_layer("encoder", 1, "none", 1, 1024, quad=0.0)["forward_ms"]
    dense = back.layer("encoder", 1, "none", 1, 1024)["forward_ms"]
    assert float(got) == pytest.approx(float(dense) - 2e-6 * 1024 ** 2)


def test_published_tables_load_and_report_fit_error(capsys):
    cm = CostModel.load(CM / "gpt_6.7b_a100.json")  # a version-1 file
    assert cm.meta["version"] == 1
    rows = [r for r in fit_report(cm) if r["tp"] == 1 and r["component"] == "encoder"]
    fwd = [r for r in rows if r["quantity"] == "forward_ms"]
    assert fwd and all(0 < r["rel_err_median"] < 0.3 for r in fwd)
    assert all(0.3 < r["quadratic_share_at_max_seq"] < 0.9 for r in fwd)  # s^2 attention at 8192, no flash
    assert main([str(CM / "cpu_tiny_gpt.json")]) == 0
    assert "rel_err_median" in capsys.readouterr().out
    assert main([str(CM / "missing.json")]) == 2
