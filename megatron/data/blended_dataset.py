"""Blending several datasets by weight (--data-path 30 a 70 b).

Sample i comes from the dataset whose realised count lags furthest behind its target
share (C++ `build_blending_indices`): deterministic, no RNG, and every prefix of the
blend is within one sample of the requested proportions.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import helpers


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """["a"] -> (["a"], None); ["30", "a", "70", "b"] -> (["a", "b"], [0.3, 0.7])."""
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty")

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) == 1 or not is_number(items[0]):
        if any(is_number(s) for s in items):
            raise ValueError(f"--data-path {' '.join(items)}: mix of weights and paths; use 'W1 P1 W2 P2 ...'")
        return items, None
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: weights and paths must come in pairs")
    weights = [float(w) for w in items[0::2]]
    prefixes = items[1::2]
    if any(is_number(p) for p in prefixes) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path {' '.join(items)}: expected 'WEIGHT PREFIX' pairs with non-negative weights")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset: need one weight per dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError("BlendedDataset: at most 32767 datasets")
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        self.datasets = datasets
        self.weights = w
        self.dataset_index = np.zeros(size, dtype=np.int16)
        self.dataset_sample_index = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(self.dataset_index, self.dataset_sample_index, w, len(datasets), size)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, c) in enumerate(zip(datasets, counts)):
            if c > len(ds):
                raise ValueError(f"BlendedDataset: dataset {d} has {len(ds)} samples but the blend needs {c}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
