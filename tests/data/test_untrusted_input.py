"""Data files someone else wrote: a forged .idx header cannot make us allocate, a negative
length is refused, and a JSONL line nested to blow the stack is one error line."""
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, write_index
from megatron.data.preprocess import _parse


def test_forged_idx_counts_are_checked_against_the_file_size(tmp_path):
    prefix = str(tmp_path / "d")
    write_index(prefix + ".idx", np.uint16, np.array([3, 2], dtype=np.int32), np.array([0, 2], dtype=np.int64))
    open(prefix + ".bin", "wb").write(b"\0" * 10)
    assert len(IndexedDataset(prefix)) == 2
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[18:26] = struct.pack("<Q", 1 << 60)  # 2**60 sequences: 13 EB of lengths and pointers
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(IndexedDatasetError, match="does not match its header"):
        IndexedDataset(prefix)


def test_negative_sequence_length_is_refused(tmp_path):
    prefix = str(tmp_path / "d")
    write_index(prefix + ".idx", np.uint16, np.array([3, 2], dtype=np.int32), np.array([0, 2], dtype=np.int64))
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[34:42] = struct.pack("<ii", 7, -2)  # still sums to 5 tokens
    open(prefix + ".idx", "wb").write(bytes(data))
    open(prefix + ".bin", "wb").write(b"\0" * 10)
    with pytest.raises(IndexedDatasetError, match="negative sequence length"):
        IndexedDataset(prefix)


def test_deeply_nested_jsonl_line_is_one_error():
    obj, err = _parse("in.jsonl", 7, b"[" * 200000, ["text"])
    assert obj is None and err.startswith("in.jsonl:7:") and "\n" not in err
