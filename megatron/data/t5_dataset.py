"""T5 span-corruption dataset (Megatron's T5Dataset semantics).

Samples are runs of whole sentences of one document (C++ `build_mapping` over
sentence-level data from `preprocess_data.py --split-sentences`), truncated to the
encoder length.  About `mask_prob` (0.15) of the tokens are masked in spans whose
lengths in words follow a geometric distribution (p = 0.2, at most `max_ngrams` = 10);
with a WordPiece tokenizer spans cover whole words, as in Megatron.  Each
span is replaced by the next sentinel <extra_id_k> in the encoder input;
    decoder input = [BOS] + sentinel_0 span_0 + sentinel_1 span_1 + ...
    labels        =         sentinel_0 span_0 + sentinel_1 span_1 + ... + [EOS]
Every sample draws from `RandomState(seed + index)`, so any rank can produce any
sample without coordination.

Items: text_enc [enc_len], text_dec [dec_len], labels [dec_len] (-1 on padding),
loss_mask [dec_len] (int64, 1 on real labels), enc_mask [enc_len, enc_len],
dec_mask [dec_len, dec_len] (causal), enc_dec_mask [dec_len, enc_len]; masks are
bool with True = may attend (torch SDPA convention), padding excluded.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np

from . import helpers
from .gpt_dataset import SPLIT_NAMES, split_ranges
from .index_cache import cached_arrays
from .indexed_dataset import IndexedDataset


def geometric_spans(num_tokens: int, mask_prob: float, rng: np.random.RandomState, max_ngrams: int = 10,
                    p: float = 0.2, max_spans: Optional[int] = None,
                    word_starts: Optional[np.ndarray] = None) -> list[tuple[int, int]]:
    """Non-overlapping, non-adjacent [start, end) spans covering about mask_prob of the
    tokens (at least one span when num_tokens > 0), sorted by start.

    Span lengths count words: n ~ Geometric(p), capped at max_ngrams.  With
    `word_starts` (bool per token, False on WordPiece "##" continuations) spans begin
    and end on word boundaries (Megatron's whole-word masking); without it every token
    is a word.  A span stops growing before it would exceed the token budget.
    """
    if num_tokens <= 0:
        return []
    budget = max(1, int(round(num_tokens * mask_prob)))
    if word_starts is None:
        starts = np.arange(num_tokens)
    else:
        starts = np.flatnonzero(np.asarray(word_starts[:num_tokens], dtype=bool))
        if len(starts) == 0 or starts[0] != 0:
            starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], num_tokens)  # word k covers tokens [starts[k], ends[k])
    covered = np.zeros(num_tokens + 1, dtype=bool)
    spans, masked = [], 0
    for w in rng.permutation(len(starts)):
        if masked >= budget or (max_spans is not None and len(spans) >= max_spans):
            break
        start = int(starts[w])
        if covered[start] or (start > 0 and covered[start - 1]):
            continue
        n = min(int(rng.geometric(p)), max_ngrams)
        end, k = start, w
        while k < min(w + n, len(starts)):
            nxt = int(ends[k])
            # Stay within budget (only the very first word may overflow it, so that a
            # sample of long words still gets one span) and one token clear of others.
            if masked + nxt - start > budget and (end > start or masked > 0):
                break
            if covered[end:nxt + 1].any():
                break
            end, k = nxt, k + 1
        if end == start:
            continue
        covered[start:end] = True
        spans.append((start, end))
        masked += end - start
    return sorted(spans)


def make_t5_example(tokens: np.ndarray, spans, sentinels, bos: int, eos: int, pad: int,
                    enc_len: int, dec_len: int) -> dict:
    """Encoder/decoder arrays for `tokens` with `spans` replaced by sentinels."""
    enc, dec_in, labels, prev = [], [bos], [], 0
    for k, (s, e) in enumerate(spans):
        enc.extend(tokens[prev:s])
        enc.append(sentinels[k])
        dec_in.append(sentinels[k])
        dec_in.extend(tokens[s:e])
        labels.append(sentinels[k])
        labels.extend(tokens[s:e])
        prev = e
    enc.extend(tokens[prev:])
    labels.append(eos)
    if len(enc) > enc_len or len(dec_in) > dec_len:
        raise ValueError(f"T5 sample does not fit: encoder {len(enc)} > {enc_len} or decoder {len(dec_in)} > {dec_len}")
    n_enc, n_dec = len(enc), len(dec_in)
    text_enc = np.full(enc_len, pad, dtype=np.int64)
    text_enc[:n_enc] = enc
    text_dec = np.full(dec_len, pad, dtype=np.int64)
    text_dec[:n_dec] = dec_in
    lab = np.full(dec_len, -1, dtype=np.int64)
    lab[:n_dec] = labels
    loss_mask = np.zeros(dec_len, dtype=np.int64)
    loss_mask[:n_dec] = 1
    enc_valid = np.arange(enc_len) < n_enc
    dec_valid = np.arange(dec_len) < n_dec
    return {
        "text_enc": text_enc, "text_dec": text_dec, "labels": lab, "loss_mask": loss_mask,
        "enc_mask": enc_valid[:, None] & enc_valid[None, :],
        "dec_mask": dec_valid[:, None] & dec_valid[None, :] & np.tri(dec_len, dtype=bool),
        "enc_dec_mask": dec_valid[:, None] & enc_valid[None, :],
    }


class T5Dataset:
    """Span-corruption samples over documents [doc_lo, doc_hi) of sentence-level data."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], num_samples: Optional[int],
                 encoder_seq_length: int, decoder_seq_length: int, tokenizer, seed: int,
                 mask_prob: float = 0.15, short_seq_prob: float = 0.1, max_ngrams: int = 10,
                 data_cache_path: Optional[str] = None, split_name: str = "train"):
        sentinels = list(getattr(tokenizer, "additional_special_tokens_ids", []) or [])
        if not sentinels:
            raise ValueError("T5 needs sentinel tokens: pass --vocab-extra-ids (e.g. 100) to the tokenizer")
        for name in ("bos", "eos", "pad"):
            if getattr(tokenizer, name, None) is None:
                raise ValueError(f"T5 needs a tokenizer with a {name} token; {type(tokenizer).__name__} has none")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {mask_prob}")
        self.indexed, self.tok, self.seed = indexed, tokenizer, seed
        self.sentinels = sentinels
        self.enc_len, self.dec_len = encoder_seq_length, decoder_seq_length
        self.mask_prob, self.max_ngrams = mask_prob, max_ngrams
        # Whole-word masking when the tokenizer marks word-continuation pieces (WordPiece "##").
        cont = getattr(tokenizer, "continuation_mask", None)
        self.continuation = np.asarray(cont(), dtype=bool) if callable(cont) else None
        lo, hi = doc_range
        docs = np.ascontiguousarray(indexed.document_indices[lo:hi + 1], dtype=np.int64)
        sizes = np.ascontiguousarray(indexed.sequence_lengths, dtype=np.int32)
        requested = num_samples if num_samples and num_samples > 0 else None
        # As many epochs as it takes to reach num_samples (one epoch if unspecified).
        epochs = 1 if requested is None else np.iinfo(np.int32).max - 1
        max_samples = requested if requested is not None else np.iinfo(np.int64).max
        description = "\n".join([
            "T5Dataset", f"path_prefix: {os.path.abspath(indexed.path_prefix)}", f"split: {split_name}",
            f"documents: {lo}..{hi}", f"num_samples: {requested}", f"encoder_seq_length: {encoder_seq_length}",
            f"short_seq_prob: {short_seq_prob}", f"seed: {seed}"])
        if data_cache_path is None:
            data_cache_path = os.path.join(os.path.dirname(os.path.abspath(indexed.path_prefix)),
                                           "cache", "T5Dataset_indices")

        def build():
            if sizes[docs[0]:docs[-1]].sum() == 0:
                raise ValueError(f"{indexed.path_prefix}: {split_name} split has no tokens")
            return {"mapping": helpers.build_mapping(docs, sizes, epochs, max_samples, encoder_seq_length,
                                                     short_seq_prob, seed, 1)}
        self.samples_mapping = cached_arrays(data_cache_path, description, f"T5Dataset-{split_name}",
                                             ["mapping"], build)["mapping"]

    def __len__(self) -> int:
        return int(self.samples_mapping.shape[0])

    def __getitem__(self, idx: int) -> dict:
        first, end, target = (int(x) for x in self.samples_mapping[idx])
        rng = np.random.RandomState((self.seed + int(idx)) % 2**32)
        tokens = np.concatenate([self.indexed[s] for s in range(first, end)]).astype(np.int64)
        tokens = tokens[:min(target, self.enc_len)]
        # The decoder holds BOS + one sentinel per span + the masked tokens; cap the
        # masked budget so that always fits in --decoder-seq-length.
        budget_prob = self.mask_prob
        max_masked = max(1, int(round(len(tokens) * budget_prob)))
        while max_masked > 1 and 1 + 2 * max_masked > self.dec_len:
            max_masked -= 1
        word_starts = None if self.continuation is None else ~self.continuation[tokens]
        spans = geometric_spans(len(tokens), max_masked / max(len(tokens), 1), rng, self.max_ngrams,
                                max_spans=len(self.sentinels), word_starts=word_starts)
        while 1 + sum(e - s + 1 for s, e in spans) > self.dec_len:
            spans = spans[:-1]
        return make_t5_example(tokens, spans, self.sentinels, self.tok.bos, self.tok.eos, self.tok.pad,
                               self.enc_len, self.dec_len)


def build_t5_datasets(data_path: Sequence[str], split: str, encoder_seq_length: int, decoder_seq_length: int,
                      tokenizer, seed: int, num_samples: Sequence[int], data_cache_path: Optional[str] = None,
                      mask_prob: float = 0.15, short_seq_prob: float = 0.1, max_ngrams: int = 10):
    """(train, valid, test) T5 datasets (None for empty splits) from sentence-level data.

    data_path: one prefix (e.g. `data/cache/kjv_sp4k_text_sentence`) or weight/prefix
    pairs for blending.  tokenizer: from build_tokenizer(..., vocab_extra_ids=N) so it has
    sentinels, bos, eos and pad.  Other arguments as in build_gpt_datasets.
    """
    from .blended_dataset import BlendedDataset, parse_data_path
    prefixes, weights = parse_data_path(data_path)
    num_samples = list(num_samples) + [0] * (3 - len(num_samples))
    if weights is None:
        weights = [1.0 / len(prefixes)] * len(prefixes)
    per = []
    for prefix, w in zip(prefixes, weights):
        indexed = IndexedDataset(prefix).require_tokens("--data-path")
        out = []
        for name, rng, n in zip(SPLIT_NAMES, split_ranges(split, indexed.num_documents), num_samples):
            want = n if len(prefixes) == 1 else int(math.ceil(math.ceil((n or 0) * w) * 1.005))
            out.append(None if rng[1] <= rng[0] else T5Dataset(
                indexed, rng, want, encoder_seq_length, decoder_seq_length, tokenizer, seed, mask_prob,
                short_seq_prob, max_ngrams, data_cache_path, name))
        per.append(out)
    if len(prefixes) == 1:
        return tuple(per[0])
    result = []
    for s in range(3):
        parts = [(d[s], w) for d, w in zip(per, weights) if d[s] is not None]
        result.append(BlendedDataset([d for d, _ in parts], [w for _, w in parts],
                                     num_samples[s] or sum(len(d) for d, _ in parts)) if parts else None)
    return tuple(result)
