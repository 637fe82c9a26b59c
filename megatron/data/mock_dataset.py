"""Generated GPT samples for --mock-data.

Sample i depends only on (seed, i), so every parallel layout sees the same samples in the same
order. Each sample is an arithmetic progression modulo the vocabulary with a random start and
stride: learnable (the loss falls well below log(vocab)) yet never trivially constant.
"""
from __future__ import annotations

import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        if vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2 for --mock-data, got {vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        rng = np.random.RandomState((self.seed * 7919 + i) % (2 ** 32))
        start = rng.randint(self.vocab_size)
        stride = rng.randint(1, min(8, self.vocab_size - 1) + 1)
        text = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {"text": text}
