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


class MockT5Dataset:
    """Generated T5 samples for --mock-data, with the keys and formats of `T5Dataset`.

    Sample i depends only on (seed, i). The encoder input is an arithmetic progression (random
    start and stride) over the content ids; the decoder must reproduce it from the start
    (labels = progression + EOS, decoder input = BOS + labels[:-1]): the first label needs
    cross-attention, the rest is learnable from the progression. Both sides have random
    per-sample lengths, so padding and every mask are exercised.

    Ids: 0 = pad, 1 = bos, 2 = eos; content ids are [3, vocab_size - num_sentinels), the last
    `num_sentinels` ids (--vocab-extra-ids) are reserved for sentinels and never generated.
    """

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, num_samples: int, encoder_seq_length: int, decoder_seq_length: int, vocab_size: int,
                 seed: int = 1234, num_sentinels: int = 0):
        self.content = vocab_size - num_sentinels - 3
        if self.content < 2:
            raise ValueError(f"--vocab-size ({vocab_size}) leaves {self.content} content ids for T5 --mock-data after "
                             f"pad/bos/eos and --vocab-extra-ids ({num_sentinels}); need at least 2")
        if encoder_seq_length < 2 or decoder_seq_length < 2:
            raise ValueError(f"T5 --mock-data needs --encoder-seq-length and --decoder-seq-length >= 2, "
                             f"got {encoder_seq_length} and {decoder_seq_length}")
        self.num_samples, self.seed = num_samples, seed
        self.enc_len, self.dec_len = encoder_seq_length, decoder_seq_length

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        rng = np.random.RandomState((self.seed * 7919 + i + 104729) % (2 ** 32))
        n_enc = rng.randint(self.enc_len // 2, self.enc_len + 1)
        n_dec = rng.randint(max(2, self.dec_len // 2), self.dec_len + 1)
        start = rng.randint(self.content)
        stride = rng.randint(1, min(8, self.content - 1) + 1)
        seq = 3 + (start + stride * np.arange(max(n_enc, n_dec), dtype=np.int64)) % self.content
        text_enc = np.full(self.enc_len, self.PAD, dtype=np.int64)
        text_enc[:n_enc] = seq[:n_enc]
        labels = np.full(self.dec_len, -1, dtype=np.int64)
        labels[:n_dec - 1] = seq[:n_dec - 1]
        labels[n_dec - 1] = self.EOS
        text_dec = np.full(self.dec_len, self.PAD, dtype=np.int64)
        text_dec[0] = self.BOS
        text_dec[1:n_dec] = labels[:n_dec - 1]
        loss_mask = (np.arange(self.dec_len) < n_dec).astype(np.int64)
        enc_valid = np.arange(self.enc_len) < n_enc
        dec_valid = loss_mask.astype(bool)
        return {
            "text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
            "enc_mask": enc_valid[:, None] & enc_valid[None, :],
            "dec_mask": dec_valid[:, None] & dec_valid[None, :] & np.tri(self.dec_len, dtype=bool),
            "enc_dec_mask": dec_valid[:, None] & enc_valid[None, :],
        }
