"""Hostile and malformed cost-model files are refused with one line naming the file."""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel, CostModelError
from megatron.planner.terapipe.latency import SliceLatencyModel, fit_context

ROOT = Path(__file__).resolve().parents[3]


def good_doc():
    return {"format": "megatron-planner-cost-model", "version": 1, "name": "t", "model": {"kind": "gpt"},
            "profiles": [{"tp": 1, "recompute": "none", "model_state_mb": {"encoder": 1.0},
                          "components": {"encoder": {"axes": ["mbs", "seq"], "mbs": [1, 2], "seq": [16, 32],
                                                     "forward_ms": [[1, 2], [2, None]],
                                                     "backward_ms": [[1, 2], [2, None]],
                                                     "stored_mb": [[1, 2], [2, None]]}}}]}


def enc(doc):
    return doc["profiles"][0]["components"]["encoder"]


def hostile(case):
    d = good_doc()
    if case == "string_in_table":
        enc(d)["forward_ms"][0][1] = "fast"
    elif case == "negative_time":
        enc(d)["backward_ms"][1][0] = -3.0
    elif case == "bool_tp":
        d["profiles"][0]["tp"] = True
    elif case == "wrong_shape":
        enc(d)["stored_mb"] = [[1, 2, 3], [2, 3, 4]]
    elif case == "huge_axis":
        enc(d)["seq"] = list(range(1, 100_000))
    elif case == "decreasing_axis":
        enc(d)["seq"] = [32, 16]
    elif case == "top_level_list":
        d = [d]
    elif case == "profiles_not_list":
        d["profiles"] = {"tp": 1}
    elif case == "unknown_component":
        d["profiles"][0]["components"]["lm_head"] = enc(d)
    elif case == "state_not_number":
        d["profiles"][0]["model_state_mb"]["encoder"] = [1]
    elif case == "nested_too_deep":
        enc(d)["forward_ms"] = [[[1, 2]], [[2, 3]]]
    return d


CASES = ["string_in_table", "negative_time", "bool_tp", "wrong_shape", "huge_axis", "decreasing_axis",
         "top_level_list", "profiles_not_list", "unknown_component", "state_not_number", "nested_too_deep"]


def test_good_document_loads(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(good_doc()))
    cm = CostModel.load(p)
    assert float(cm.layer("encoder", 1, "none", 1, 16)["forward_ms"]) == 1.0


@pytest.mark.parametrize("case", CASES)
def test_hostile_documents_are_refused_in_one_line(tmp_path, case):
    p = tmp_path / f"{case}.json"
    p.write_text(json.dumps(hostile(case)))
    with pytest.raises(CostModelError) as e:
        CostModel.load(p)
    msg = str(e.value)
    assert str(p) in msg and "\n" not in msg and len(msg) < 400


@pytest.mark.parametrize("text", [
    '{"format": "megatron-planner-cost-model", "version": 1, "profiles": [], "x": NaN}',
    '{"format": "megatron-planner-cost-model", "version": 1, "profiles": [], "x": Infinity}',
    "[" * 100_000 + "]" * 100_000,
    "\udcff not utf-8 \xff",
])
def test_nan_literals_deep_nesting_and_garbage_are_refused(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CostModelError, match=str(p).replace("\\", "\\\\")):
        CostModel.load(p)


def test_shipped_tables_pass():
    for name in ("gpt_6.7b_a100", "t5_11b_a100", "cpu_tiny_gpt", "cpu_tiny_t5"):
        CostModel.load(ROOT / "cost_models" / f"{name}.json")
    SliceLatencyModel.load(ROOT / "cost_models" / "terapipe_cpu_tiny_gpt.json")


def _latency(tmp_path, coef, t0=((1.0, 2.0), (2.0, 3.0))):
    p = tmp_path / "lat.json"
    p.write_text(json.dumps({"format": "megatron-terapipe-latency", "version": 1, "mbs": [1, 2], "seq": [8, 16],
                             "t0_ms": [list(r) for r in t0], "context_coef": coef, "hidden_size": 64}))
    return p


@pytest.mark.parametrize("coef,why", [
    ([-0.02, 0.04, -0.0001], "negative"),  # the fit issue 23 found in the shipped file
    ([0.01, -0.01, 0.0], "falls"),
    ([0.01, 0.01, float("nan")], "cannot read"),
    ([0.01, "x", 0.0], "3 finite numbers"),
])
def test_terapipe_latency_model_refuses_negative_or_falling_times(tmp_path, coef, why):
    p = _latency(tmp_path, coef)
    with pytest.raises(ValueError, match=why) as e:
        SliceLatencyModel.load(p)
    assert str(p) in str(e.value)


def test_terapipe_negative_table_entry_refused_and_good_model_loads(tmp_path):
    with pytest.raises(ValueError, match="negative"):
        SliceLatencyModel.load(_latency(tmp_path, [0.0, 0.0, 0.001], t0=((1.0, -2.0), (2.0, 3.0))))
    m = SliceLatencyModel.load(_latency(tmp_path, [0.0, 0.01, 0.001]))
    assert m.layer_ms(1, 8, 16) > m.layer_ms(1, 8, 0) > 0


def test_context_fit_is_non_negative_and_exact_when_truth_is():
    rng = np.random.default_rng(0)
    pts = [(b, l, c, 0.002 * b * l + 0.0005 * b * l * c) for b in (1, 2) for l in (8, 16) for c in (16, 32)]
    np.testing.assert_allclose(fit_context(pts), (0.002, 0.0, 0.0005), atol=1e-12)
    noisy = [(b, l, c, 0.0001 * b * c + rng.normal(0, 0.05)) for b, l, c, _ in pts]
    assert min(fit_context(noisy)) >= 0
