"""A forged `.idx` whose middle sequence pointers lie (far past the .bin, negative, or back at
the start) while the first and last stay right: refused at open naming the first bad entry,
never trained on."""
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, write_index

LENGTHS = np.array([5, 3, 4, 6, 2], dtype=np.int32)


def _pair(tmp_path):
    prefix = str(tmp_path / "d")
    write_index(prefix + ".idx", np.uint16, LENGTHS, np.arange(len(LENGTHS) + 1, dtype=np.int64))
    open(prefix + ".bin", "wb").write(np.arange(LENGTHS.sum(), dtype=np.uint16).tobytes())
    return prefix


@pytest.mark.parametrize("forged", [1 << 40, -1000, 0, 7])
def test_forged_middle_pointer_is_refused_naming_it(tmp_path, forged):
    prefix = _pair(tmp_path)
    assert [int(x[0]) for x in IndexedDataset(prefix)[0:5]] == [0, 5, 8, 12, 18]
    data = bytearray(open(prefix + ".idx", "rb").read())
    ptr = 34 + 4 * len(LENGTHS) + 8 * 2  # sequence 2 of 5
    data[ptr:ptr + 8] = struct.pack("<q", forged)
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert f"sequence 2 points at byte {forged} " in msg and "at byte 16 " in msg and "\n" not in msg, msg


def test_every_chunk_is_checked(tmp_path, monkeypatch):
    from megatron.data import indexed_dataset
    monkeypatch.setattr(indexed_dataset, "_CHUNK", 2)  # the bad entry sits in a later chunk
    prefix = _pair(tmp_path)
    data = bytearray(open(prefix + ".idx", "rb").read())
    ptr = 34 + 4 * len(LENGTHS) + 8 * 3
    data[ptr:ptr + 8] = struct.pack("<q", 2)
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(IndexedDatasetError, match="sequence 3 points at byte 2 .* at byte 24 "):
        IndexedDataset(prefix)
