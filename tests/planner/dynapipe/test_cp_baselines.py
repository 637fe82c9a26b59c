"""CP over packed rows, the fair baseline (megatron/planner/dynapipe/cp_baselines.py)."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.core.context_parallel import chunk_token_index
from megatron.data.packing import pack_samples, packed_attention_mask
from megatron.experiments.slicing import planner_for
from megatron.planner.cost.cp_cost import cp_planner
from megatron.planner.dynapipe import packed
from megatron.planner.dynapipe.baselines import baselines
from megatron.planner.dynapipe.cp_baselines import (PackedCPAttention, cp_packed_time, packed_cp_planner, rank_quad,
                                                    row_rank_pairs)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_row_split_pairs_are_what_the_runtimes_chunks_and_document_mask_attend(cp):
    # The oracle: the runtime's own chunking (core/context_parallel.py) and the packed rows'
    # per-document causal mask (data/packing.py), counted entry by entry.
    rng = np.random.default_rng(cp)
    row_len = 96
    lengths = [5, 17, 1, 30, 9, 20]  # 82 tokens: the row ends in padding
    docs = [rng.integers(1, 100, size=n) for n in lengths]
    seg = pack_samples(docs, row_len, rows=[list(range(len(docs)))])["segment_ids"]
    mask = packed_attention_mask(seg)[0, 0] & torch.as_tensor(seg[0] > 0)[:, None]  # padding rows excluded
    want = [int(mask[chunk_token_index(row_len, cp, r)].sum()) for r in range(cp)]
    assert row_rank_pairs(lengths, row_len, cp, gap=0).tolist() == want
    assert sum(want) == sum(n * (n + 1) // 2 for n in lengths)


def test_one_document_is_balanced_either_way_and_many_are_not_under_the_row_split():
    assert row_rank_pairs([64], 64, 4, gap=0).tolist() == [64 * 65 / 2 / 4] * 4
    e = [[0, 1, 2, 3]]
    lengths = [16, 16, 16, 15]  # + their label tokens: 64 positions
    doc = rank_quad("gpt", lengths, 64, [e], 2, "document")
    row = rank_quad("gpt", lengths, 64, [e], 2, "row")
    assert doc[0] == pytest.approx(sum(n * n for n in lengths) / 2)
    assert row[0] > doc[0]  # the row's 2N chunks leave whole documents to one rank
    with pytest.raises(ValueError, match="2 x CP = 8 equal chunks"):
        row_rank_pairs([10], 60, 4)


@pytest.fixture(scope="module")
def planner_cp4():
    return packed_cp_planner(planner_for(2, 8).cfg, 4)


def test_a_row_of_one_document_costs_what_the_dense_cp_model_charges(planner_cp4):
    cm, att = planner_cp4.cm, planner_cp4.attention
    assert isinstance(att, PackedCPAttention)
    for comm in ("p2p", "all_gather"):
        att = PackedCPAttention(type(cm)(cm.base, 4, comm))
        dense = att.cp.layer("encoder", 1, "selective", 1.0, 8192.0)
        one = att.packed_layer("encoder", 1, "selective", 1.0, 8192.0, 8192.0 ** 2 / 4)
        for q in dense:
            assert float(one[q]) == pytest.approx(float(dense[q]), rel=1e-12)


def test_short_documents_attend_less_but_hide_less_of_the_ring(planner_cp4):
    cm = planner_cp4.cm
    s, q_docs = 8192.0, 16 * 512.0 ** 2 / 4  # 16 documents of 512 tokens, each cut over 4 ranks
    for comm in ("all_gather", "p2p"):  # over a 100 Gb/s link (across nodes), where the ring is not free
        att = PackedCPAttention(type(cm)(cm.base, 4, comm, link_gbps=100.0))
        dense = att.cp.layer("encoder", 1, "none", 1.0, s)
        docs = att.packed_layer("encoder", 1, "none", 1.0, s, q_docs)
        assert docs["stored_mb"] == dense["stored_mb"]  # flash kernels: memory is linear in tokens
        for q in ("forward_ms", "backward_ms"):
            saved = att.split(1, "none", "encoder", q).coef["quad"] * (s * s / 4 - q_docs)
            assert saved > 0
            got = float(dense[q] - docs[q])
            if comm == "all_gather":  # exposed exchange: the attention saved is all saved
                assert got == pytest.approx(saved, rel=1e-9)
            else:  # the ring's blocks hide behind less attention: less than that is saved
                assert 0 < got < saved


def test_at_cp_1_the_baseline_is_the_per_document_packing_baseline():
    from bench_planner import make_batches
    batch = make_batches("gpt", 8192, 65536, 1, seed=9192, mixture="multitask")[0]
    plain = planner_for(2, 4)
    want = baselines(plain, "gpt", batch, 8192, names=("packing_varlen",))["packing_varlen"]
    assert cp_packed_time(packed_cp_planner(plain.cfg, 1), batch, 8192, 1) == want


def test_per_document_cp_is_never_slower_than_the_same_rows_attended_densely():
    from bench_planner import make_batches
    batch = make_batches("gpt", 8192, 65536, 1, seed=9192, mixture="multitask")[0]
    cfg = planner_for(2, 4).cfg
    fair = cp_packed_time(packed_cp_planner(cfg, 2), batch, 8192, 2)
    dense = baselines(cp_planner(cfg, 2), "gpt", batch, 8192, names=("packing",))["packing"]
    assert np.isfinite(fair[0]) and fair[0] <= dense[0]
    row = cp_packed_time(packed_cp_planner(cfg, 2), batch, 8192, 2, "row")
    assert fair[0] <= row[0] < dense[0]
    assert packed.next_fit("gpt", batch, 8192)  # the rows both price
