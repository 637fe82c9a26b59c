"""Smoke test of benchmarks/bench_pipeline.py: its real code path (forked gloo ranks, trainer,
instrumented executor, saved-tensor meter) on a tiny GPT at PP=2, checking the JSON fields and
the in-flight bounds. Timings are printed by the benchmark, never asserted here."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.bench_pipeline import SavedActivationMeter, expected_inflight, main

TINY = ["--pp", "2", "--hidden", "32", "--heads", "4", "--layers", "4", "--seq", "16", "--vocab", "101",
        "--micro-batch-size", "1", "--microbatches", "4", "--warmup", "1", "--iters", "1", "--timeout", "120"]

LINE_FIELDS = {
    "benchmark", "schedule", "pp", "vpp_chunks", "cores", "ranks_per_core", "oversubscribed",
    "iter_ms_median", "pipeline_ms_median", "t_f_ms", "t_b_ms", "t_f_ms_per_rank", "t_b_ms_per_rank",
    "analytic_ms", "measured_over_analytic", "ideal_ms", "analytic_bubble_fraction",
    "measured_bubble_fraction", "compute_ms_per_rank", "comm_wait_ms_per_rank",
    "peak_live_records_per_rank", "expected_inflight_per_rank", "inflight_ok",
    "peak_saved_activation_bytes_per_rank", "saved_bytes_per_inflight_microbatch_per_rank",
}


def test_pp2_1f1b_and_gpipe_lines(capsys):
    assert main(TINY + ["--schedules", "1f1b", "gpipe"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    by = {ln["schedule"]: ln for ln in lines if ln["benchmark"] == "pipeline_schedule"}
    (summary,) = [ln for ln in lines if ln["benchmark"] == "pipeline_schedule_summary"]
    assert set(by) == {"1f1b", "gpipe"}
    pp, m = 2, 4
    for ln in by.values():
        assert LINE_FIELDS <= set(ln), LINE_FIELDS - set(ln)
        assert ln["pp"] == pp and ln["microbatches"] == m and ln["vpp_chunks"] == 1
        assert ln["cores"] >= 1 and ln["oversubscribed"] == (pp > ln["cores"])
        for key in ("t_f_ms_per_rank", "t_b_ms_per_rank", "peak_saved_activation_bytes_per_rank"):
            assert len(ln[key]) == pp and all(x > 0 for x in ln[key]), (key, ln[key])
        assert ln["analytic_ms"] > 0 and ln["pipeline_ms_median"] > 0
        assert ln["analytic_bubble_fraction"] == pytest.approx((pp - 1) / m)
        assert ln["inflight_ok"]
    one, gp = by["1f1b"], by["gpipe"]
    # 1F1B: rank r holds at most PP - r micro-batches; GPipe holds all of them on every rank.
    assert one["one_f_one_b_bound_ok"] and one["peak_live_records_per_rank"] == [2, 1]
    assert gp["gpipe_holds_all_ok"] and gp["peak_live_records_per_rank"] == [m, m]
    # Saved activations scale with micro-batches in flight (same model, same micro-batch shape).
    for r in range(pp):
        assert gp["peak_saved_activation_bytes_per_rank"][r] > one["peak_saved_activation_bytes_per_rank"][r]
    assert summary["one_f_one_b_bound_ok"] and summary["gpipe_holds_all_ok"]
    assert summary["saved_bytes_ratio_gpipe_over_1f1b_per_rank"] == pytest.approx([2.0, 4.0], rel=0.05)


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 2)])
def test_expected_inflight_matches_schedule_definitions(pp, m):
    assert expected_inflight("1f1b", pp, m, 1) == [min(pp - r, m) for r in range(pp)]
    assert expected_inflight("gpipe", pp, m, 1) == [m] * pp


def test_saved_activation_meter_counts_unique_storages_and_releases():
    w = torch.nn.Parameter(torch.randn(64, 64))
    meter = SavedActivationMeter({w.untyped_storage().data_ptr()})
    x = torch.randn(8, 64, requires_grad=True)
    with meter.hooks():
        h = x @ w  # saves x (and w, excluded as a parameter)
        y = (h * h).sum()  # saves h twice: one storage, counted once
    assert meter.live == x.untyped_storage().nbytes() + h.untyped_storage().nbytes()
    del h
    y.backward()
    assert meter.live == 0 and meter.peak == 2 * 8 * 64 * 4
