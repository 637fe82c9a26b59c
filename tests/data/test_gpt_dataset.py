import os

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset, build_gpt_datasets, split_ranges
from megatron.data.indexed_dataset import IndexedDataset

from .util import make_dataset, random_docs


def test_split_ranges_megatron_rounding():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("98,2", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(ValueError, match="--split"):
        split_ranges("a,b", 10)


def test_one_epoch_uses_every_token_once(tmp_path):
    docs = random_docs(50, seed=1)
    prefix = make_dataset(str(tmp_path / "d"), docs)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(50), None, seq_length=16, seed=3,
                    data_cache_path=str(tmp_path / "cache"))
    total = sum(len(d[0]) for d in docs)
    assert ds.num_epochs == 1 and len(ds) == (total - 1) // 16
    stream = np.concatenate([np.asarray(docs[i][0]) for i in ds.document_index])
    samples = [ds.get_tokens(i) for i in range(len(ds))]
    for i, s in enumerate(samples):
        assert len(s) == 17
        # Sample i covers stream[16 i : 16 i + 17]: consecutive samples share one boundary token.
        np.testing.assert_array_equal(s, stream[16 * i:16 * i + 17])
    # Shuffled access returns the same multiset of samples.
    shuffled = sorted(tuple(ds[i]["text"]) for i in range(len(ds)))
    assert shuffled == sorted(tuple(s) for s in samples)
    assert ds[0]["text"].dtype == np.int64


def test_several_epochs_and_separate_final_epoch(tmp_path):
    docs = random_docs(20, seed=2)
    prefix = make_dataset(str(tmp_path / "d"), docs)
    total = sum(len(d[0]) for d in docs)
    per_epoch = (total - 1) // 8
    # 2.1 epochs: the final epoch gives 10% (< 80%) of an epoch, so it is shuffled separately.
    want = int(2.1 * per_epoch)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(20), want, 8, seed=5, data_cache_path=None)
    assert ds.num_epochs == 3 and len(ds) >= want
    counts = np.bincount(ds.document_index, minlength=20)
    assert (counts == 3).all()
    # The last 20 entries are one whole epoch (each document exactly once).
    assert sorted(ds.document_index[-20:].tolist()) == list(range(20))
    n_before = (2 * total - 1) // 8
    assert set(ds.shuffle_index[:n_before].tolist()) == set(range(n_before))


def test_cache_written_once_and_reused(tmp_path):
    prefix = make_dataset(str(tmp_path / "d"), random_docs(30))
    cache = str(tmp_path / "cache")
    a = GPTDataset(IndexedDataset(prefix), np.arange(30), 40, 8, 1, cache, "train")
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and any(f.endswith("description.txt") for f in files)
    mtimes = {f: os.path.getmtime(os.path.join(cache, f)) for f in files}
    b = GPTDataset(IndexedDataset(prefix), np.arange(30), 40, 8, 1, cache, "train")
    assert {f: os.path.getmtime(os.path.join(cache, f)) for f in files} == mtimes
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    c = GPTDataset(IndexedDataset(prefix), np.arange(30), 40, 8, 2, cache, "train")  # other seed
    assert len(os.listdir(cache)) == 2 * len(files)
    assert not np.array_equal(a.document_index, c.document_index)


def test_build_gpt_datasets_splits(tmp_path):
    prefix = make_dataset(str(tmp_path / "d"), random_docs(100))
    train, valid, test = build_gpt_datasets([prefix], "90,10,0", 8, 1, (50, 5, 0), str(tmp_path / "c"))
    assert test is None and len(train) >= 50 and len(valid) >= 5
    assert set(train.document_index.tolist()) <= set(range(90))
    assert set(valid.document_index.tolist()) <= set(range(90, 100))


def test_blending_ratios(tmp_path):
    a = make_dataset(str(tmp_path / "a"), [[[1] * 40] for _ in range(30)])
    b = make_dataset(str(tmp_path / "b"), [[[2] * 40] for _ in range(30)])
    train, _, _ = build_gpt_datasets(["30", a, "70", b], "1", 8, 1, (1000, 0, 0), str(tmp_path / "c"))
    assert len(train) == 1000
    src = train.dataset_index
    assert abs((src == 0).sum() - 300) <= 1
    for k in (10, 100, 555):  # every prefix is within one sample of the weights
        assert abs((src[:k] == 0).sum() - 0.3 * k) <= 1.0 + 1e-9
    first = {int(train[i]["text"][0]) for i in range(50)}
    assert first == {1, 2}
    for i in range(50):
        assert train[i]["text"][0] == (1 if src[i] == 0 else 2)


def test_unweighted_blend_by_size_and_bad_paths(tmp_path):
    a = make_dataset(str(tmp_path / "a"), [[[1] * 10] for _ in range(10)])
    b = make_dataset(str(tmp_path / "b"), [[[2] * 30] for _ in range(10)])
    train, _, _ = build_gpt_datasets([a, b], "1", 4, 1, (400, 0, 0), None)
    assert abs((train.dataset_index == 0).mean() - 0.25) < 0.01
    with pytest.raises(ValueError, match="pairs"):
        build_gpt_datasets(["30", a, "70"], "1", 4, 1, (10, 0, 0))


def test_distributed_cache_built_by_rank0(tmp_path):
    from tests.dist_harness import run_distributed
    prefix = make_dataset(str(tmp_path / "d"), random_docs(40))
    out = run_distributed(_dist_build, 2, prefix, str(tmp_path / "cache"))
    assert out[0] == out[1]


def _dist_build(rank, world, prefix, cache):
    from megatron.data import gpt_dataset
    calls = []
    orig = gpt_dataset.GPTDataset._build_indices

    def counting(self, *a):
        calls.append(1)
        return orig(self, *a)
    gpt_dataset.GPTDataset._build_indices = counting
    ds, _, _ = gpt_dataset.build_gpt_datasets([prefix], "1", 8, 7, (30, 0, 0), cache)
    assert len(calls) == (1 if rank == 0 else 0), (rank, calls)
    return ds.shuffle_index.tolist()


def test_unwritable_cache_warns_and_still_works(tmp_path):
    prefix = make_dataset(str(tmp_path / "d"), random_docs(10))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="--data-cache-path"):
        ds = GPTDataset(IndexedDataset(prefix), np.arange(10), 5, 8, 1, str(blocker / "cache"))
    assert len(ds) >= 5


def test_split_by_documents_on_sentence_level_data(tmp_path):
    # 4 documents with 3, 1, 2, 2 sentences: a 50/50 split puts sentences 0-3 in train.
    docs = [[[1] * 5, [2] * 5, [3] * 5], [[4] * 5], [[5] * 5, [6] * 5], [[7] * 5, [8] * 5]]
    prefix = make_dataset(str(tmp_path / "s"), docs)
    train, valid, test = build_gpt_datasets([prefix], "50,50,0", 4, 1, (0, 0, 0), None)
    assert test is None
    assert sorted(set(train.document_index.tolist())) == [0, 1, 2, 3]
    assert sorted(set(valid.document_index.tolist())) == [4, 5, 6, 7]
    tokens = {int(t) for i in range(len(valid)) for t in valid[i]["text"]}
    assert tokens <= {5, 6, 7, 8}
