import os
import sys

import numpy as np

from megatron.data.indexed_dataset import IndexedDataset
from tests.data.util import make_dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import merge_datasets as tool  # noqa: E402


def test_merge_cli(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    make_dataset(str(shards / "b"), [[[3, 4]]])
    make_dataset(str(shards / "a"), [[[1], [2]]])
    assert tool.main(["--input-dir", str(shards), "--output-prefix", str(tmp_path / "all")]) == 0
    ds = IndexedDataset(str(tmp_path / "all"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2], [3, 4]]
    assert ds.document_indices.tolist() == [0, 2, 3]
    make_dataset(str(tmp_path / "wide"), [[[5]]], dtype=np.int32)
    assert tool.main(["--input", str(shards / "a"), str(tmp_path / "wide"), "--output-prefix", str(tmp_path / "x")]) == 1
    assert "dtype" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.idx") and not os.path.exists(tmp_path / "x.bin.tmp")
