"""Multi-task supervised data: aligned inputs and targets datasets.

Preprocess both keys of a JSON-lines file in one run (`--json-keys inputs targets`),
then document i of `{prefix}_inputs_document` and of `{prefix}_targets_document` is one
(input, target) pair.  Lengths come from the .idx files alone, so a planner can form
token-budget batches without reading any token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .gpt_dataset import SPLIT_NAMES, split_ranges
from .indexed_dataset import IndexedDataset, idx_path


def document_lengths(ds: IndexedDataset) -> np.ndarray:
    """Tokens per document (sum of its sequences), int64; documents may be empty."""
    cum = np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])
    return cum[ds.document_indices[1:]] - cum[ds.document_indices[:-1]]


class SupervisedDataset:
    """`ds[i] = {"inputs": int64[...], "targets": int64[...]}` for pairs `indices` (all by default)."""

    def __init__(self, inputs_prefix: str, targets_prefix: str, indices: Optional[np.ndarray] = None):
        self.inputs = IndexedDataset(inputs_prefix).require_tokens("--data-path")
        self.targets = IndexedDataset(targets_prefix).require_tokens("--targets-data-path")
        if self.inputs.num_documents != self.targets.num_documents:
            raise ValueError(
                f"{idx_path(inputs_prefix)} has {self.inputs.num_documents} documents but "
                f"{idx_path(targets_prefix)} has {self.targets.num_documents}; --data-path and "
                "--targets-data-path must come from the same preprocess_data.py run")
        n = self.inputs.num_documents
        self.indices = np.arange(n, dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
        self.input_lengths = document_lengths(self.inputs)[self.indices]
        self.target_lengths = document_lengths(self.targets)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    @staticmethod
    def _doc(ds: IndexedDataset, d: int) -> np.ndarray:
        lo, hi = int(ds.document_indices[d]), int(ds.document_indices[d + 1])
        if hi == lo:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([ds[s] for s in range(lo, hi)]).astype(np.int64)

    def __getitem__(self, i: int) -> dict:
        d = int(self.indices[i])
        return {"inputs": self._doc(self.inputs, d), "targets": self._doc(self.targets, d)}


def build_supervised_datasets(data_path: Sequence[str], targets_data_path: Sequence[str], split: str):
    """(train, valid, test) SupervisedDatasets split by --split over pairs (None if empty).

    data_path / targets_data_path: one prefix each (--data-path / --targets-data-path).
    """
    if len(data_path) != 1 or len(targets_data_path) != 1:
        raise ValueError("supervised data takes one --data-path prefix and one --targets-data-path prefix")
    full = SupervisedDataset(data_path[0], targets_data_path[0])
    out = []
    for (lo, hi), _ in zip(split_ranges(split, len(full)), SPLIT_NAMES):
        out.append(None if hi <= lo else SupervisedDataset(data_path[0], targets_data_path[0], np.arange(lo, hi)))
    return tuple(out)
