"""The stage costs that clock the zero-bubble greedy at run time (megatron/planner/schedule/zb_costs.py):
W and the output layer's ratios from a table's measured columns, the hand values only without them."""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.schedule.zb_costs import (OUT_BWD_RATIO, analytic_stage_costs, head_ratios, run_stage_costs,
                                                table_stage_costs)
from megatron.planner.schedule.zb_search import derive_wgrad

CM = Path(__file__).resolve().parents[3] / "cost_models"


def _raw_head(path, rc="none"):
    """The table file's own output-layer grid, read without the project's loader."""
    prof = next(p for p in json.loads(Path(path).read_text())["profiles"] if p["tp"] == 1 and p["recompute"] == rc)
    return {k: np.asarray(v, float) for k, v in prof["components"]["postprocess"].items() if k.endswith("_ms")}


def test_w_is_the_measured_share_where_the_table_has_the_halves():
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    c = table_stage_costs(cm, [2, 2], 3, 1, "none", 4, 128)
    lay, post = cm.layer("encoder", 1, "none", 4, 128), cm.postprocess(1, "none", 4, 128)
    share = lambda g: float(g["weight_grad_ms"] / (g["input_grad_ms"] + g["weight_grad_ms"]))  # noqa: E731
    assert c.wgrad[0, 0] == pytest.approx(2 * float(lay["backward_ms"]) * share(lay))
    assert c.wgrad[1, 0] == pytest.approx(2 * float(lay["backward_ms"]) * share(lay)
                                          + float(post["backward_ms"]) * share(post))
    # not what the derivation from the forward gives
    derived = derive_wgrad(np.array([[2 * float(lay["forward_ms"])]]), np.array([[2 * float(lay["backward_ms"])]]),
                           64, 128)[0, 0]
    assert abs(c.wgrad[0, 0] - derived) > 0.05 * derived


def test_without_the_halves_the_hand_rule_stands():
    cm = CostModel.load(CM / "gpt_6.7b_a100.json")
    c = table_stage_costs(cm, [16, 16], 2, 1, "none", 1, 2048)
    lay, post = cm.layer("encoder", 1, "none", 1, 2048), cm.postprocess(1, "none", 1, 2048)
    w_layers = derive_wgrad(np.array([[16 * float(lay["forward_ms"])]]), np.array([[16 * float(lay["backward_ms"])]]),
                            4096, 2048)[0, 0]
    assert c.wgrad[0, 0] == pytest.approx(w_layers)
    assert c.wgrad[1, 0] == pytest.approx(w_layers + min(float(post["forward_ms"]), float(post["backward_ms"]) / 2))
    ratio, share = head_ratios(cm, 1)
    raw = _raw_head(CM / "gpt_6.7b_a100.json")
    assert share is None and ratio == pytest.approx(float(np.nanmedian(raw["backward_ms"] / raw["forward_ms"])))
    assert head_ratios(cm, 3) == (OUT_BWD_RATIO, None)  # no TP 3 row: the documented fallback


def test_the_estimate_takes_the_measured_head_when_the_table_lacks_the_runs_layers(tmp_path):
    src = CM / "cpu_tiny_gpt.json"
    doc = json.loads(src.read_text())
    for p in doc["profiles"]:  # a table of the head only: the run's layer row is missing
        del p["components"]["encoder"]
    path = tmp_path / "head_only.json"
    path.write_text(json.dumps(doc))
    raw = _raw_head(src)
    ratio = float(np.nanmedian(raw["backward_ms"] / raw["forward_ms"]))
    share = float(np.nanmedian(raw["weight_grad_ms"] / (raw["input_grad_ms"] + raw["weight_grad_ms"])))
    model = SimpleNamespace(hidden_size=64, seq_length=128, ffn_hidden_size=256, padded_vocab_size=lambda tp: 4096)
    cfg = lambda table: SimpleNamespace(model=model, data=SimpleNamespace(dynapipe_cost_model=table),  # noqa: E731
                                        training=SimpleNamespace(recompute_level="none", micro_batch_size=4))
    got = run_stage_costs(cfg(str(path)), 1, [2, 2])(3)
    hand = run_stage_costs(cfg(None), 1, [2, 2])(3)
    assert ratio < 1.0 < OUT_BWD_RATIO  # on this CPU the head's backward is cheaper than its forward
    out_f = got.fwd[1, 0] - got.fwd[0, 0]
    assert got.bwd[1, 0] - got.bwd[0, 0] == pytest.approx(ratio * out_f)
    assert got.wgrad[1, 0] - got.wgrad[0, 0] == pytest.approx(share * ratio * out_f)
    assert hand.bwd[1, 0] - hand.bwd[0, 0] == pytest.approx(OUT_BWD_RATIO * out_f)
    assert np.allclose(hand.fwd, analytic_stage_costs([2, 2], 3, 64, 128, 4096, 256).fwd)
