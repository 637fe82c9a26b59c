"""The zero-bubble baselines of `bench_planner.py --zero-bubble` on the shipped GPT-6.7B A100 table
(PP 4 x DP 2): ZB over packed rows with per-document attention (what a torchtitan / Megatron-Core
user runs) runs the same rows as the 1F1B `packing_varlen` baseline, and on them no slower; on a
batch with a long tail, padding each micro-batch to its longest (the old `_fixed` baseline) is slower."""
from pathlib import Path

import numpy as np

from megatron.planner.dynapipe.baselines import baselines
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from megatron.planner.schedule.zb_baselines import zb_fixed_time, zb_packed_time

ROOT = Path(__file__).resolve().parents[3]


def test_zb_on_packed_rows_beats_1f1b_on_them_and_zb_on_padded_samples():
    cfg = DynaPipeConfig(cost_model_path=str(ROOT / "cost_models" / "gpt_6.7b_a100.json"), model_kind="gpt",
                         hidden_size=4096, num_layers=32, pipeline_parallel=4, data_parallel=2,
                         memory_limit_mb=36000, schedules=("1f1b", "zb"))
    planner = DynaPipePlanner(cfg)
    rng = np.random.default_rng(0)
    batch = [int(x) for x in np.clip(rng.lognormal(np.log(300), 1.0, 60), 16, 2047)]
    one_f_one_b, b, _ = baselines(planner, "gpt", batch, 2048, names=("packing_varlen",))["packing_varlen"]
    for schedule in ("zb-h1", "zb-v"):
        t, rows, rc = zb_packed_time(planner, "gpt", batch, 2048, schedule)
        assert np.isfinite(t) and rows is not None and rc is not None
        assert t <= one_f_one_b * (1 + 1e-9), (schedule, t, one_f_one_b)
        assert t < zb_fixed_time(planner, "gpt", batch, 2048, schedule)[0]
