import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                           IndexedDatasetError, merge_datasets, optimal_dtype)


def _build(prefix, docs, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for sent in doc:
            b.add_item(np.array(sent))
        b.end_document()
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 200, rng.integers(0, 30)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(40)]
    prefix = str(tmp_path / "ds")
    _build(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    flat = [s for d in docs for s in d]
    assert len(ds) == len(flat) and ds.dtype == np.dtype(dtype)
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s
    assert ds.num_documents == len(docs)
    assert ds.document_indices.tolist() == [0] + np.cumsum([len(d) for d in docs]).tolist()
    long = max(range(len(flat)), key=lambda i: len(flat[i]))
    assert ds.get(long, 2, 3).tolist() == flat[long][2:5]
    assert not os.path.exists(prefix + ".bin.tmp")


def test_hand_written_idx(tmp_path):
    # Two documents: doc0 = sentences [5, 6, 7] and [8]; doc1 = [9, 10]; uint16 (code 8).
    prefix = str(tmp_path / "hand")
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<6H", 5, 6, 7, 8, 9, 10))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<QQ", 3, 3))
        f.write(struct.pack("<3i", 3, 1, 2))
        f.write(struct.pack("<3q", 0, 6, 8))
        f.write(struct.pack("<3q", 0, 2, 3))
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7], [8], [9, 10]]
    assert ds.document_indices.tolist() == [0, 2, 3]
    # Our builder writes exactly the same bytes.
    _build(str(tmp_path / "ours"), [[[5, 6, 7], [8]], [[9, 10]]], np.uint16)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "ours") + ext, "rb").read()


def test_merge(tmp_path):
    a, b, out = (str(tmp_path / n) for n in "abm")
    _build(a, [[[1, 2]], [[3]]], np.uint16)
    _build(b, [[[4], [5, 6]]], np.uint16)
    merge_datasets([a, b], out)
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [5, 6]]
    assert ds.document_indices.tolist() == [0, 1, 2, 4]


def test_truncated_and_foreign(tmp_path):
    prefix = str(tmp_path / "t")
    _build(prefix, [[[1, 2, 3]], [[4, 5]]], np.int32)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:-5])
    with pytest.raises(IndexedDatasetError, match=r"t\.idx.*truncated"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(data)
    binary = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(binary[:-4])
    with pytest.raises(IndexedDatasetError, match=r"t\.bin.*truncated"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"TNTIDX\x00\x00" + data[8:])
    with pytest.raises(IndexedDatasetError, match="not a Megatron mmap index"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(str(tmp_path / "missing"))


def test_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_item([1, 2])
    b.abort()
    assert os.listdir(tmp_path) == []


def test_dtype_overflow_and_choice(tmp_path):
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(100000) == np.int32
    b = IndexedDatasetBuilder(str(tmp_path / "o.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="does not fit"):
        b.add_item(np.array([70000], dtype=np.int64))
    b.abort()


def test_corrupt_pointers_and_doc_indices(tmp_path):
    prefix = str(tmp_path / "c")
    _build(prefix, [[[1, 2, 3]], [[4, 5]]], np.int32)
    data = bytearray(open(prefix + ".idx", "rb").read())
    ptr_off = 34 + 2 * 4
    bad = data.copy()
    bad[ptr_off + 8:ptr_off + 16] = struct.pack("<q", 4)  # second pointer should be 12
    open(prefix + ".idx", "wb").write(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="sequence 1 points at byte 4 "):
        IndexedDataset(prefix)
    bad = data.copy()
    bad[-8:] = struct.pack("<q", 7)  # last document ends past the 2 sequences
    open(prefix + ".idx", "wb").write(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="document_indices"):
        IndexedDataset(prefix)
