from pathlib import Path

import numpy as np
import pytest

from megatron.data.packing import next_fit_rows, pack_samples
from megatron.pipeline.validator import validate_plans
from megatron.planner.dynapipe import packed
from megatron.planner.dynapipe.baselines import NAMES, BalancedStream, baselines, microbatch_shapes
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner

CM = Path(__file__).resolve().parents[3] / "cost_models"


def tiny_gpt(**kw):
    base = dict(cost_model_path=str(CM / "cpu_tiny_gpt.json"), hidden_size=64, num_layers=4,
                pipeline_parallel=2, data_parallel=1, memory_limit_mb=200, packed_rows=True, packed_max_len=256)
    base.update(kw)
    return DynaPipeConfig(**base)


def batch(seed, n=60, hi=256):
    rng = np.random.default_rng(seed)
    return np.minimum(hi, rng.lognormal(np.log(40), 0.9, n).astype(int) + 4).tolist()


def test_planner_rows_are_the_rows_the_data_path_builds():
    lens = batch(0)
    rows = packed.next_fit("gpt", lens, 256)
    seqs = [np.arange(n + 1) + 1 for n in lens]  # a GPT sample occupies its length + 1 tokens
    got = pack_samples(seqs, 257)["segment_ids"]
    assert got.shape[0] == len(rows)
    for r, row in enumerate(rows):
        assert np.bincount(got[r])[1:].tolist() == [lens[i] + 1 for i in row]
    assert next_fit_rows([(3, 1), (2, 2), (1, 2)], 4) == [[0], [1, 2]]  # T5: both sides must fit


def test_paper_packing_baseline_is_priced_on_the_rows_the_data_path_builds():
    # Two 128-token samples fill a 256-token row, but as GPT samples they take 129 + 129 of a
    # 257-token row: the runtime needs a row for each, and so does the baseline's price.
    lens = [128] * 8 + batch(2)
    planner = DynaPipePlanner(tiny_gpt())
    built = pack_samples([np.arange(n + 1) + 1 for n in lens], 257)["tokens"].shape[0]
    for b in (1, 4):
        shapes = microbatch_shapes(planner, "gpt", "packing", lens, 256, b)
        assert sum(m for m, _, _ in shapes) == built and all(m <= b and s == 256 for m, s, _ in shapes)
    assert [len(r) for r in packed.next_fit("gpt", lens, 256)[:7]] == [1] * 7


@pytest.mark.parametrize("kind", ["gpt", "t5"])
def test_balanced_places_every_document_once_within_rows(kind):
    planner = DynaPipePlanner(tiny_gpt()) if kind == "gpt" else None
    rng = np.random.default_rng(1)
    lens = batch(1) if kind == "gpt" else [(int(a), int(b)) for a, b in rng.integers(1, 200, (50, 2))]
    if planner is None:
        planner = DynaPipePlanner(DynaPipeConfig(cost_model_path=str(CM / "cpu_tiny_t5.json"), model_kind="t5",
                                                 hidden_size=64, encoder_layers=2, decoder_layers=2,
                                                 pipeline_parallel=2, memory_limit_mb=200))
    for b in (1, 3, 8):
        mbs = packed.balanced(planner, kind, lens, 256, b)
        flat = sorted(i for m in mbs for r in m for i in r)
        assert flat == list(range(len(lens)))
        sizes, cap = packed.row_sizes(kind, lens, 256)
        assert all(len(m) <= b for m in mbs)
        assert all(np.all(np.sum(sizes[r], axis=0) <= cap) for m in mbs for r in m)


def test_dynapipe_with_packed_rows_never_loses_to_a_baseline_and_lowers():
    planner = DynaPipePlanner(tiny_gpt())
    for seed in range(3):
        lens = batch(seed)
        plan = planner.plan(lens, iteration=seed)
        base = baselines(planner, "gpt", lens, 256, sizes=(1, 2, 4, 8))
        assert set(base) == set(NAMES)
        best = min(v[0] for v in base.values())
        assert plan.makespan_ms <= best * (1 + 1e-9)
        seen = sorted(i for g in plan.groups for mb in g.microbatches for i in mb)
        assert seen == list(range(len(lens)))
        for g in plan.groups:
            validate_plans(g.plans)
            if g.rows is not None:  # a packed plan: rows of 256 tokens, shapes (rows, 256)
                for mb, rows, shape in zip(g.microbatches, g.rows, g.shapes):
                    assert sorted(mb) == sorted(i for r in rows for i in r)
                    assert shape == ((len(rows), 256),)
                    assert all(sum(lens[i] + 1 for i in r) <= 257 for r in rows)


def test_balanced_stream_defers_long_documents_a_bounded_time_and_drops_none():
    stream = BalancedStream("gpt", 100, threshold=0.5, max_delay=1)
    batches = [[90, 5], [80, 70, 60, 5], [10], [95, 85, 75, 20]]
    out = [stream.next(b, last=k == len(batches) - 1) for k, b in enumerate(batches)]
    assert sorted(x for o in out for x in o) == sorted(x for b in batches for x in b)
    # running-mean quota: 1, then 2 of the 3 (60 waits), then 60 (waited its one iteration),
    # the last batch takes what is still queued
    assert [sorted(x for x in o if x > 50) for o in out] == [[90], [70, 80], [60], [75, 85, 95]]


def test_t5_packed_plan_rows_fit_encoder_and_decoder_lengths():
    cfg = DynaPipeConfig(cost_model_path=str(CM / "cpu_tiny_t5.json"), model_kind="t5", hidden_size=64,
                         encoder_layers=2, decoder_layers=2, pipeline_parallel=2, memory_limit_mb=400,
                         decoder_extra_tokens=0, packed_rows=True, packed_max_len=64, packed_dec_len=32)
    planner = DynaPipePlanner(cfg)
    rng = np.random.default_rng(3)
    lens = [(int(a), int(b)) for a, b in zip(rng.integers(2, 40, 40), rng.integers(2, 12, 40))]
    plan = planner.plan(lens)
    rows = packed.next_fit("t5", lens, (64, 32))
    assert all(sum(lens[i][0] for i in r) <= 64 and sum(lens[i][1] for i in r) <= 32 for r in rows)
    for g in plan.groups:
        validate_plans(g.plans)
        if g.rows is not None:
            for rows, shape in zip(g.rows, g.shapes):
                (b, se), (b2, sd) = shape
                assert b == b2 == len(rows) and se == 64 and sd <= 32
                assert all(sum(lens[i][0] for i in r) <= se and sum(lens[i][1] for i in r) <= sd for r in rows)
