"""The C++ index builders against straightforward Python versions of the same rules."""
import importlib

import numpy as np
import pytest

from megatron.data import helpers


def _sample_idx_reference(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    stream_doc = np.concatenate([np.full(sizes[d], k) for k, d in enumerate(doc_idx)])
    stream_off = np.concatenate([np.arange(sizes[d]) for d in doc_idx])
    n = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = []
    for s in range(n + 1):
        pos = s * seq_length  # sample s starts at token s*seq_length of the epoch stream
        if pos < len(stream_doc):
            out.append((stream_doc[pos], stream_off[pos]))
        else:  # the end of the last sample points just past the final token
            out.append((len(doc_idx) - 1, sizes[doc_idx[-1]] - 1))
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
def test_build_sample_idx_matches_reference(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 30, 25).astype(np.int32)
    epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(np.arange(25, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    seq = int(rng.integers(2, 40))
    got = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, int(sizes.sum()))
    ref = _sample_idx_reference(sizes, doc_idx, seq, epochs, int(sizes.sum()))
    # Compare as absolute stream positions (a boundary may be written as the end of one
    # document or the start of the next; Megatron's loop yields the former).
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx])])
    np.testing.assert_array_equal(starts[got[:, 0]] + got[:, 1], starts[ref[:, 0]] + ref[:, 1])
    assert got.dtype == np.int32


def test_blending_indices_greedy():
    w = np.array([0.5, 0.3, 0.2])
    di = np.zeros(1000, np.int16)
    dsi = np.zeros(1000, np.int64)
    helpers.build_blending_indices(di, dsi, w, 3, 1000)
    for d in range(3):
        assert abs((di == d).sum() - w[d] * 1000) <= 1
        np.testing.assert_array_equal(dsi[di == d], np.arange((di == d).sum()))  # consecutive samples


def test_build_mapping_covers_documents():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 20, 200).astype(np.int32)
    docs = np.array([0, 10, 10, 50, 120, 200], dtype=np.int64)  # includes an empty document
    m = helpers.build_mapping(docs, sizes, 1, 10**9, 64, 0.0, 3, 1)
    # One epoch, no short samples: the samples tile every non-empty document exactly.
    covered = sorted((int(a), int(b)) for a, b, _ in m)
    assert sum(b - a for a, b in covered) == 200
    for a, b in covered:
        k = np.searchsorted(docs, a, side="right") - 1
        assert docs[k] <= a < b <= docs[k + 1]  # never crosses a document boundary
    assert (m[:, 2] == 64).all()
    short = helpers.build_mapping(docs, sizes, 5, 10**9, 64, 0.5, 3, 1)
    assert (short[:, 2] < 64).mean() > 0.3 and len(short) > len(m)
    assert len(helpers.build_mapping(docs, sizes, 100, 37, 64, 0.1, 3, 1)) == 37


def test_clear_error_when_extension_missing(monkeypatch):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "megatron.data.helpers_cpp":
            raise ImportError("No module named 'megatron.data.helpers_cpp'")
        return real(name, *a, **k)
    monkeypatch.setattr(helpers, "_module", None)
    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"python setup.py build_ext --inplace"):
        helpers.build_sample_idx(np.ones(3, np.int32), np.arange(3, dtype=np.int32), 1, 1, 3)
