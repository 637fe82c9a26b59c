"""The host calibration: fitted from runs, stored with its table, applied by every planner."""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.calibration import IDENTITY, HostCalibration, fit
from megatron.planner.cost.cost_model import CostModel, CostModelError
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from megatron.planner.schedule.schedules import one_f_one_b
from megatron.planner.schedule.simulator import PipelineCosts, simulate
from megatron.planner.terapipe.latency import SliceLatencyModel

CM = Path(__file__).resolve().parents[3] / "cost_models"
CAL = HostCalibration(1.3, 0.7, 12.0)


def calibrated_table(tmp_path, cal=CAL, name="cpu_tiny_gpt.json"):
    doc = json.loads((CM / name).read_text())
    doc.pop("calibration", None)
    if cal is not None:
        doc["calibration"] = cal.to_dict()
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def planner_for(path, **kw):
    return DynaPipePlanner(DynaPipeConfig(cost_model_path=path, model_kind="gpt", hidden_size=64, num_layers=4,
                                          pipeline_parallel=2, memory_limit_mb=200.0, emit_plans=False, **kw))


def test_stage_costs_apply_the_calibration_to_every_op(tmp_path):
    (tmp_path / "a").mkdir()
    plain = planner_for(calibrated_table(tmp_path / "a", None))
    cal = planner_for(calibrated_table(tmp_path))
    assert plain.calibration == IDENTITY and cal.calibration == CAL
    mbs, seq = np.array([1.0, 4.0, 16.0]), np.array([256.0, 64.0, 32.0])
    a, b = plain.stage_costs("none", mbs, seq), cal.stage_costs("none", mbs, seq)
    for k in ("fwd", "bwd"):
        np.testing.assert_allclose(b[k], a[k] * CAL.compute_scale + CAL.op_overhead_ms, rtol=1e-12)
    for k in ("stored", "peak", "comm"):  # memory and transfers are not the host's compute
        np.testing.assert_array_equal(b[k], a[k])


def test_plans_report_the_step_overhead_and_pay_per_microbatch(tmp_path):
    (tmp_path / "a").mkdir()
    plain = planner_for(calibrated_table(tmp_path / "a", None))
    heavy = planner_for(calibrated_table(tmp_path, HostCalibration(1.0, 4.0, 25.0)))
    lens = np.random.default_rng(0).integers(16, 250, 40).tolist()
    p0, p1 = plain.plan(lens), heavy.plan(lens)
    for plan, planner in ((p0, plain), (p1, heavy)):
        assert plan.makespan_ms == pytest.approx(max(g.makespan_ms for g in plan.groups)
                                                 + planner.calibration.step_overhead_ms)
    # a per-instruction overhead makes many small micro-batches dearer: never more of them
    count = lambda p: sum(len(g.microbatches) for g in p.groups)  # noqa: E731
    assert count(p1) <= count(p0)
    assert p1.makespan_ms > p0.makespan_ms + 25.0


def _runs():
    """A few uniform 1F1B runs priced from the CPU table (two stages)."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    out = []
    for b, s, n in ((1, 256, 4), (2, 64, 12), (4, 32, 16), (8, 32, 8), (1, 64, 16)):
        layer = cm.layer("encoder", 1, "none", b, s)
        post = cm.postprocess(1, "none", b, s)
        f = np.array([[2 * layer["forward_ms"]] * n, [2 * layer["forward_ms"] + post["forward_ms"]] * n], float)
        bw = np.array([[2 * layer["backward_ms"]] * n, [2 * layer["backward_ms"] + post["backward_ms"]] * n], float)
        z = np.zeros_like(f)
        out.append((f, bw, z, one_f_one_b(2, list(range(n)))))
    return out


def _predict(runs):
    def predict(scale, overhead):
        return [simulate(PipelineCosts(f * scale + overhead, b * scale + overhead, z, z, z + 0.05), o).makespan
                for f, b, z, o in runs]
    return predict


def test_fit_recovers_a_known_calibration():
    predict = _predict(_runs())
    truth = (1.37, 1.85, 9.0)
    measured = np.asarray(predict(*truth[:2])) + truth[2]
    got = fit(measured, predict)
    assert got.compute_scale == pytest.approx(truth[0], abs=0.011)
    assert got.op_overhead_ms == pytest.approx(truth[1], abs=0.051)
    assert got.step_overhead_ms == pytest.approx(truth[2], abs=1.0)
    assert got.meta["max_abs_error"] < 0.01


def test_fit_with_noise_stays_close():
    predict = _predict(_runs())
    rng = np.random.default_rng(3)
    clean = np.asarray(predict(1.2, 1.0)) + 15.0
    got = fit(clean * rng.uniform(0.97, 1.03, clean.shape), predict)
    pred = np.asarray(predict(got.compute_scale, got.op_overhead_ms)) + got.step_overhead_ms
    assert np.max(np.abs(pred / clean - 1)) < 0.06


@pytest.mark.parametrize("bad", [[1.0, 2.0], [1.0, -2.0, 3.0], [1.0, float("nan"), 3.0]])
def test_fit_refuses_too_few_or_bad_measurements(bad):
    with pytest.raises(ValueError, match="positive measured"):
        fit(bad, lambda a, g: [1.0] * len(bad))


@pytest.mark.parametrize("doc,msg", [({"compute_scale": 0}, "compute_scale"), ({"op_overhead_ms": -1}, "op_overhead"),
                                     ({"step_overhead_ms": "x"}, "step_overhead"), ([1], "object")])
def test_bad_calibration_blocks_name_the_field(tmp_path, doc, msg):
    path = tmp_path / "t.json"
    d = json.loads((CM / "cpu_tiny_gpt.json").read_text())
    d["calibration"] = doc
    path.write_text(json.dumps(d))
    with pytest.raises((CostModelError, ValueError), match=msg):
        planner_for(str(path))


def test_latency_model_applies_and_keeps_its_calibration(tmp_path):
    m = SliceLatencyModel.load(CM / "terapipe_cpu_tiny_gpt.json")
    m.calibration = IDENTITY
    base = m.stage_ms(1, 128, 64, 2)
    m.calibration = CAL
    p2p = 2 * m.p2p_ms(1, 128)
    assert m.stage_ms(1, 128, 64, 2) == pytest.approx((base - p2p) * CAL.compute_scale + 2 * CAL.op_overhead_ms + p2p)
    m.save(tmp_path / "lat.json")
    again = SliceLatencyModel.load(tmp_path / "lat.json")
    assert again.calibration == CAL


def test_the_embedding_is_priced_on_the_stage_that_runs_it(tmp_path):
    """CPU tables profile the embedding (`preprocess`): its time is part of stage 0's ops."""
    doc = json.loads((CM / "cpu_tiny_gpt.json").read_text())
    doc.pop("calibration", None)
    (tmp_path / "with.json").write_text(json.dumps(doc))
    for p in doc["profiles"]:
        del p["components"]["preprocess"]
    (tmp_path / "without.json").write_text(json.dumps(doc))
    a, b = planner_for(str(tmp_path / "with.json")), planner_for(str(tmp_path / "without.json"))
    mbs, seq = np.array([1.0, 8.0]), np.array([256.0, 32.0])
    sa, sb = a.stage_costs("none", mbs, seq), b.stage_costs("none", mbs, seq)
    pre = a.cm.preprocess(1, "none", mbs, seq)
    np.testing.assert_allclose(sa["fwd"][0] - sb["fwd"][0], pre["forward_ms"], rtol=1e-9)
    np.testing.assert_allclose(sa["bwd"][0] - sb["bwd"][0], pre["backward_ms"], rtol=1e-9)
    np.testing.assert_array_equal(sa["fwd"][1], sb["fwd"][1])
