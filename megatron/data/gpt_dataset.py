"""GPT pretraining dataset with Megatron's document / sample / shuffle index semantics.

For a split of documents and a requested number of samples:
  * epochs E: the fewest with E * tokens_per_epoch >= num_samples * seq_length + 1;
  * document_index: the split's document ids tiled E times and shuffled
    (RandomState(seed)); if the last epoch would contribute < 80% of an epoch's
    samples it is shuffled separately, so the partial epoch is not biased towards
    documents that happened to be shuffled to the front of a joint permutation;
  * sample_index [N+1, 2]: where each sample starts (position in document_index,
    token offset), built in C++; samples are seq_length + 1 tokens, and consecutive
    samples share one token (the last label of one is the first input of the next),
    so every token of an epoch is used exactly once as an input;
  * shuffle_index: a permutation of the samples (again, final partial epoch separately).
`ds[i]` returns {"text": int64[seq_length + 1]}; tokens = text[:-1], labels = text[1:].
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np

from . import helpers
from .blended_dataset import BlendedDataset, parse_data_path
from .index_cache import cached_arrays
from .indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '0.9 0.1' / '98,2') -> three fractions summing to 1."""
    parts = [p for p in split.replace("/", ",").replace(" ", ",").split(",") if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected comma-separated numbers such as 949,50,1") from None
    if not values or len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: need 1 to 3 non-negative weights with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous document ranges per split, rounded as Megatron does."""
    fracs = parse_split(split)
    bounds = [0]
    for f in fracs:
        bounds.append(bounds[-1] + int(round(f * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int, add_extra_token: int = 1) -> int:
    if tokens_per_epoch <= add_extra_token:
        raise ValueError(f"split has only {tokens_per_epoch} tokens; cannot make samples of --seq-length {seq_length}")
    needed = num_samples * seq_length + add_extra_token
    return max(1, math.ceil(needed / tokens_per_epoch))


class GPTDataset:
    """Fixed-length samples over the documents `document_ids` of an IndexedDataset.

    A document here is one sequence of the indexed dataset (the `_document` output of
    preprocess_data); sentence-level data would make every sentence a document.
    """

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, num_samples: Optional[int],
                 seq_length: int, seed: int, data_cache_path: Optional[str] = None,
                 split_name: str = "train", add_extra_token: int = 1):
        if seq_length <= 0:
            raise ValueError(f"--seq-length must be positive, got {seq_length}")
        self.indexed = indexed
        self.seq_length = seq_length
        self.add_extra_token = add_extra_token
        document_ids = np.asarray(document_ids, dtype=np.int32)
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[document_ids].astype(np.int64).sum())
        requested = num_samples if num_samples and num_samples > 0 else None
        epochs = 1 if requested is None else num_epochs_for(tokens_per_epoch, seq_length, requested, add_extra_token)
        if requested is None and tokens_per_epoch <= add_extra_token:
            raise ValueError(f"{indexed.path_prefix}: {split_name} split has no tokens")
        description = "\n".join([
            "GPTDataset", f"path_prefix: {os.path.abspath(indexed.path_prefix)}", f"split: {split_name}",
            f"documents: {document_ids[0] if len(document_ids) else 0}..{document_ids[-1] if len(document_ids) else 0}"
            f" ({len(document_ids)})", f"num_samples: {requested}", f"seq_length: {seq_length}",
            f"seed: {seed}", f"add_extra_token: {add_extra_token}", f"tokens_per_epoch: {tokens_per_epoch}"])
        if data_cache_path is None:
            data_cache_path = os.path.join(os.path.dirname(os.path.abspath(indexed.path_prefix)),
                                           "cache", "GPTDataset_indices")

        def build():
            return self._build_indices(document_ids, sizes, tokens_per_epoch, epochs, requested, seed)

        arrays = cached_arrays(data_cache_path, description, f"GPTDataset-{split_name}",
                               ["document_index", "sample_index", "shuffle_index"], build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.num_epochs = epochs

    def _build_indices(self, document_ids, sizes, tokens_per_epoch, epochs, requested, seed):
        rng = np.random.RandomState(seed)
        separate_final = False
        if epochs > 1:
            per_epoch = (tokens_per_epoch - self.add_extra_token) // self.seq_length
            before_final = ((epochs - 1) * tokens_per_epoch - self.add_extra_token) // self.seq_length
            from_final = requested - before_final
            separate_final = from_final < int(0.80 * per_epoch)
        if separate_final:
            first = np.tile(document_ids, epochs - 1)
            rng.shuffle(first)
            last = document_ids.copy()
            rng.shuffle(last)
            doc_index = np.concatenate([first, last])
        else:
            doc_index = np.tile(document_ids, epochs)
            rng.shuffle(doc_index)
        doc_index = doc_index.astype(np.int32)
        sample_index = helpers.build_sample_idx(np.ascontiguousarray(sizes, dtype=np.int32), doc_index,
                                                self.seq_length, epochs, tokens_per_epoch, True,
                                                self.add_extra_token)
        total = sample_index.shape[0] - 1
        dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
        if separate_final:
            before = ((epochs - 1) * tokens_per_epoch - self.add_extra_token) // self.seq_length
            a = np.arange(before, dtype=dtype)
            rng.shuffle(a)
            b = np.arange(before, total, dtype=dtype)
            rng.shuffle(b)
            shuffle = np.concatenate([a, b])
        else:
            shuffle = np.arange(total, dtype=dtype)
            rng.shuffle(shuffle)
        return {"document_index": doc_index, "sample_index": sample_index, "shuffle_index": shuffle}

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def get_tokens(self, idx: int) -> np.ndarray:
        """Tokens of the (unshuffled) sample idx, length seq_length + add_extra_token."""
        doc_f, off_f = (int(x) for x in self.sample_index[idx])
        doc_l, off_l = (int(x) for x in self.sample_index[idx + 1])
        di = self.document_index
        if doc_f == doc_l:
            parts = [self.indexed.get(int(di[doc_f]), off_f, off_l - off_f + self.add_extra_token)]
        else:
            parts = [self.indexed.get(int(di[doc_f]), off_f)]
            parts += [self.indexed.get(int(di[k])) for k in range(doc_f + 1, doc_l)]
            parts.append(self.indexed.get(int(di[doc_l]), 0, off_l + self.add_extra_token))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range ({len(self)})")
        return {"text": self.get_tokens(int(self.shuffle_index[idx]))}


def _build_split_datasets(prefix, split, seq_length, seed, num_samples, data_cache_path):
    indexed = IndexedDataset(prefix).require_tokens("--data-path")
    ranges = split_ranges(split, indexed.num_documents)
    out = []
    doc_bounds = indexed.document_indices
    for name, (lo, hi), n in zip(SPLIT_NAMES, ranges, num_samples):
        if hi <= lo:
            out.append(None)
            continue
        # Sequences of documents lo..hi (equal to lo..hi for document-level data).
        ids = np.arange(int(doc_bounds[lo]), int(doc_bounds[hi]), dtype=np.int32)
        out.append(GPTDataset(indexed, ids, n, seq_length, seed, data_cache_path, name))
    return out


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int,
                       num_samples: Sequence[int], data_cache_path: Optional[str] = None):
    """(train, valid, test) GPT datasets; None for an empty split.

    data_path: Megatron's --data-path list, either prefixes (`["a", "b"]`, weighted by
    token count) or weight/prefix pairs (`["30", "a", "70", "b"]`) for blending.
    split: --split such as "949,50,1" (applied to every blended dataset).
    num_samples: samples wanted per split (train_iters * global batch, ...); 0 or None
    means one epoch.  Index arrays are cached under data_cache_path (default
    `<data dir>/cache/GPTDataset_indices`); with torch.distributed initialised, rank 0
    builds them and the other ranks wait at a barrier.
    """
    prefixes, weights = parse_data_path(data_path)
    num_samples = list(num_samples) + [0] * (3 - len(num_samples))
    if len(prefixes) == 1:
        return tuple(_build_split_datasets(prefixes[0], split, seq_length, seed, num_samples, data_cache_path))
    if weights is None:  # Megatron: without weights, blend in proportion to size
        sizes = [float(IndexedDataset(p).sequence_lengths.astype(np.int64).sum()) for p in prefixes]
        weights = [s / sum(sizes) for s in sizes]
    per_dataset = []
    for p, w in zip(prefixes, weights):
        # Each component gets a 0.5% surplus so the greedy blend never runs it dry.
        want = [int(math.ceil(math.ceil((n or 0) * w) * 1.005)) for n in num_samples]
        per_dataset.append(_build_split_datasets(p, split, seq_length, seed, want, data_cache_path))
    result = []
    for s in range(3):
        parts = [(d[s], w) for d, w in zip(per_dataset, weights) if d[s] is not None]
        if not parts:
            result.append(None)
            continue
        size = num_samples[s] or sum(len(d) for d, _ in parts)
        result.append(BlendedDataset([d for d, _ in parts], [w for _, w in parts], size))
    return tuple(result)
