"""Small helpers shared by the data tests."""
import numpy as np

from megatron.data.indexed_dataset import IndexedDatasetBuilder


def make_dataset(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(np.asarray(seq))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def random_docs(n, seed=0, lo=1, hi=60, vocab=1000):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, rng.integers(lo, hi)).tolist()] for _ in range(n)]
