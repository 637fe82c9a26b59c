"""Turning variable-length samples into fixed-shape batches: packing and padding.

* `pack_samples`: next-fit packing of several samples per row, with segment ids and
  per-sample position ids; `packed_attention_mask` makes the causal, block-diagonal
  mask so packed samples never attend to each other (the reference DynaPipe code
  packed without such a mask, letting samples leak into one another).
* `collate_supervised_gpt` / `collate_supervised_t5`: one (input, target) pair per row,
  padded; for GPT the loss covers the target tokens only.
* `padding_stats`: real tokens / computed tokens of any of these batches.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def next_fit_rows(sizes, capacity) -> list:
    """The one definition of a packed row, shared by the data path, the planners' cost model
    and the baselines: samples in order, next-fit into rows of `capacity` tokens; a sample that
    does not fit the current row's free space closes it. `sizes`: tokens per sample (GPT), or
    (encoder, decoder) pairs (T5: both sides must fit; `capacity` one length for both or an
    (encoder, decoder) pair). Sizes are clipped to the capacity; empty samples are skipped.
    Returns rows as lists of sample indices."""
    rows, free = [], None
    cap = np.asarray(capacity, dtype=np.int64)
    for i, s in enumerate(np.minimum(np.asarray(sizes, dtype=np.int64), cap).tolist()):
        s = s if isinstance(s, list) else [s]
        if not any(v > 0 for v in s):
            continue
        if free is None or any(v > f for v, f in zip(s, free)):
            rows.append([])
            free = np.broadcast_to(cap, (len(s),)).tolist()
        rows[-1].append(i)
        free = [f - v for f, v in zip(free, s)]
    return rows


def pack_samples(samples: Sequence[np.ndarray], max_len: int, pad_id: int = 0,
                 loss_starts: Sequence[int] | None = None, rows: Sequence[Sequence[int]] | None = None) -> dict:
    """Pack samples into rows of max_len tokens: next-fit (`next_fit_rows`) unless `rows`
    (lists of sample indices, each fitting max_len, e.g. a planner's) is given.

    Samples longer than max_len are truncated to max_len; empty samples are skipped.
    Inside each sample, labels[j] = tokens[j + 1] and the sample's last position has no label
    (loss_mask 0), so no label crosses a sample boundary.  Returns numpy arrays [rows, max_len]:
    tokens, labels (int64), loss_mask (float32), position_ids (reset to 0 per sample),
    segment_ids (1..k per sample within the row, 0 on padding).
    `loss_starts[i]` (supervised pairs: the input length of sample i) restricts the loss to
    labels at or after that position of the sample, i.e. to the target tokens.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    samples = [np.asarray(s, dtype=np.int64)[:max_len] for s in samples]
    if rows is None:
        rows = next_fit_rows([s.size for s in samples], max_len)
    n = len(rows)
    out = {
        "tokens": np.full((n, max_len), pad_id, dtype=np.int64),
        "labels": np.full((n, max_len), pad_id, dtype=np.int64),
        "loss_mask": np.zeros((n, max_len), dtype=np.float32),
        "position_ids": np.zeros((n, max_len), dtype=np.int64),
        "segment_ids": np.zeros((n, max_len), dtype=np.int64),
    }
    for r, row in enumerate(rows):
        pos = 0
        for k, i in enumerate(row, start=1):
            s = samples[i]
            q = 0 if loss_starts is None else int(loss_starts[i])
            L = s.size
            if pos + L > max_len:
                raise ValueError(f"row {r} holds {pos + L} tokens, more than its {max_len}")
            sl = slice(pos, pos + L)
            out["tokens"][r, sl] = s
            out["labels"][r, pos:pos + L - 1] = s[1:]
            out["loss_mask"][r, pos + max(q - 1, 0):pos + L - 1] = 1.0
            out["position_ids"][r, sl] = np.arange(L)
            out["segment_ids"][r, sl] = k
            pos += L
    return out


def packed_attention_mask(segment_ids, query_start: int = 0):
    """Bool mask [b, 1, s - query_start, s] for torch SDPA (True = may attend) from segment ids
    [b, s]: the rows of queries query_start.. (a token slice whose keys are the whole prefix).

    Position i attends to j iff j <= i and both are in the same (non-zero) segment.
    Padding positions (segment 0) attend only to themselves, so no softmax row is
    empty (an all-False row gives NaN in SDPA); their outputs are ignored anyway.
    """
    import torch
    seg = torch.as_tensor(segment_ids)
    if seg.dim() != 2:
        raise ValueError(f"segment_ids must be [batch, seq], got shape {tuple(seg.shape)}")
    s, c = seg.shape[1], query_start
    q = seg[:, c:]
    causal = torch.ones(s - c, s, dtype=torch.bool, device=seg.device).tril_(c)
    same = (q[:, :, None] == seg[:, None, :]) & (q[:, :, None] > 0)
    eye = torch.ones(s - c, s, dtype=torch.bool, device=seg.device).tril_(c).triu_(c)  # key = the query itself
    pad_self = (q == 0)[:, :, None] & eye
    return ((same & causal) | pad_self).unsqueeze(1)


def concat_pair(inputs, targets, seq_length: int):
    """inputs + targets as one sequence of at most seq_length + 1 tokens, and how many of its
    leading tokens are inputs. Input tokens go first from the left (the target is what is
    trained on; at least one input token stays to predict from), then target tokens from the right."""
    inp = np.asarray(inputs, dtype=np.int64)
    tgt = np.asarray(targets, dtype=np.int64)
    excess = inp.size + tgt.size - (seq_length + 1)
    if excess > 0:
        cut = min(excess, max(inp.size - 1, 0))
        inp = inp[cut:]
        tgt = tgt[:seq_length + 1 - inp.size]
    return np.concatenate([inp, tgt]), inp.size


def collate_supervised_gpt(pairs: Sequence[dict], seq_length: int, pad_id: int = 0) -> dict:
    """One concatenated sequence per (inputs, targets) pair, for decoder-only models.

    x = inputs + targets; tokens = x[:-1], labels = x[1:]; loss_mask is 1 exactly where
    the label is a target token.  Sequences longer than seq_length + 1 lose input tokens
    from the left first (the target is what is trained on), then target tokens from the
    right.  Returns numpy [b, seq_length] tokens, labels, loss_mask (float32),
    position_ids, attention_mask [b, 1, s, s] is left to `packed_attention_mask(segment_ids)`
    with segment_ids 1 on real tokens and 0 on padding.
    """
    b = len(pairs)
    out = {
        "tokens": np.full((b, seq_length), pad_id, dtype=np.int64),
        "labels": np.full((b, seq_length), pad_id, dtype=np.int64),
        "loss_mask": np.zeros((b, seq_length), dtype=np.float32),
        "position_ids": np.tile(np.arange(seq_length, dtype=np.int64), (b, 1)),
        "segment_ids": np.zeros((b, seq_length), dtype=np.int64),
    }
    for r, p in enumerate(pairs):
        x, n_in = concat_pair(p["inputs"], p["targets"], seq_length)
        n = x.size - 1
        if n <= 0:
            continue
        out["tokens"][r, :n] = x[:-1]
        out["labels"][r, :n] = x[1:]
        # label j is x[j+1]; it is a target token when j + 1 >= len(inputs)
        out["loss_mask"][r, max(n_in - 1, 0):n] = 1.0
        out["segment_ids"][r, :n] = 1
    return out


def collate_supervised_t5(pairs: Sequence[dict], encoder_seq_length: int, decoder_seq_length: int,
                          bos: int, eos: int, pad: int) -> dict:
    """Encoder = inputs, decoder input = [bos] + targets, labels = targets + [eos], padded
    (labels -1 on padding) and truncated to the given lengths; masks as in t5_dataset."""
    b = len(pairs)
    enc = np.full((b, encoder_seq_length), pad, dtype=np.int64)
    dec = np.full((b, decoder_seq_length), pad, dtype=np.int64)
    lab = np.full((b, decoder_seq_length), -1, dtype=np.int64)
    lm = np.zeros((b, decoder_seq_length), dtype=np.int64)
    n_enc = np.zeros(b, dtype=np.int64)
    n_dec = np.zeros(b, dtype=np.int64)
    for r, p in enumerate(pairs):
        i = np.asarray(p["inputs"], dtype=np.int64)[:encoder_seq_length]
        t = np.asarray(p["targets"], dtype=np.int64)[:decoder_seq_length - 1]
        enc[r, :i.size] = i
        dec[r, :t.size + 1] = np.concatenate([[bos], t])
        lab[r, :t.size + 1] = np.concatenate([t, [eos]])
        lm[r, :t.size + 1] = 1
        n_enc[r], n_dec[r] = i.size, t.size + 1
    ev = np.arange(encoder_seq_length)[None, :] < n_enc[:, None]
    dv = np.arange(decoder_seq_length)[None, :] < n_dec[:, None]
    return {
        "text_enc": enc, "text_dec": dec, "labels": lab, "loss_mask": lm,
        "enc_mask": ev[:, :, None] & ev[:, None, :],
        "dec_mask": dv[:, :, None] & dv[:, None, :] & np.tri(decoder_seq_length, dtype=bool)[None],
        "enc_dec_mask": dv[:, :, None] & ev[:, None, :],
    }


def pack_t5_rows(pairs: Sequence[dict], rows: Sequence[Sequence[int]], encoder_seq_length: int,
                 decoder_seq_length: int, bos: int, eos: int, pad: int) -> dict:
    """T5 packed rows: row r holds the pairs rows[r] (indices into `pairs`), their inputs one
    after another on the encoder side and their `[bos] + targets` / `targets + [eos]` on the
    decoder side, truncated as `collate_supervised_t5` truncates one pair (a pair occupies
    (len(inputs), len(targets) + 1) tokens, see `next_fit_rows`). Per-document masks: encoder
    and decoder self-attention block-diagonal (the decoder's also causal), cross-attention
    only to the same pair's inputs; position ids restart at 0 for every pair (relative
    position buckets are offset-invariant, so within a pair nothing changes). Padding as in
    `collate_supervised_t5`."""
    n = len(rows)
    out = {"text_enc": np.full((n, encoder_seq_length), pad, dtype=np.int64),
           "text_dec": np.full((n, decoder_seq_length), pad, dtype=np.int64),
           "labels": np.full((n, decoder_seq_length), -1, dtype=np.int64),
           "loss_mask": np.zeros((n, decoder_seq_length), dtype=np.int64),
           "enc_position_ids": np.zeros((n, encoder_seq_length), dtype=np.int64),
           "dec_position_ids": np.zeros((n, decoder_seq_length), dtype=np.int64)}
    seg_e = np.zeros((n, encoder_seq_length), dtype=np.int64)
    seg_d = np.zeros((n, decoder_seq_length), dtype=np.int64)
    for r, row in enumerate(rows):
        pe = pd = 0
        for k, i in enumerate(row, start=1):
            inp = np.asarray(pairs[i]["inputs"], dtype=np.int64)[:encoder_seq_length]
            tgt = np.asarray(pairs[i]["targets"], dtype=np.int64)[:decoder_seq_length - 1]
            le, ld = inp.size, tgt.size + 1
            if pe + le > encoder_seq_length or pd + ld > decoder_seq_length:
                raise ValueError(f"row {r} holds more than ({encoder_seq_length}, {decoder_seq_length}) tokens")
            out["text_enc"][r, pe:pe + le] = inp
            out["enc_position_ids"][r, pe:pe + le] = np.arange(le)
            seg_e[r, pe:pe + le] = k
            out["text_dec"][r, pd:pd + ld] = np.concatenate([[bos], tgt])
            out["labels"][r, pd:pd + ld] = np.concatenate([tgt, [eos]])
            out["loss_mask"][r, pd:pd + ld] = 1
            out["dec_position_ids"][r, pd:pd + ld] = np.arange(ld)
            seg_d[r, pd:pd + ld] = k
            pe, pd = pe + le, pd + ld
    same = lambda a, b: (a[:, :, None] == b[:, None, :]) & (a[:, :, None] > 0)  # noqa: E731
    out["enc_mask"] = same(seg_e, seg_e)
    out["dec_mask"] = same(seg_d, seg_d) & np.tri(decoder_seq_length, dtype=bool)[None]
    out["enc_dec_mask"] = same(seg_d, seg_e)
    return out


def padding_stats(*valid_masks) -> dict:
    """Padding efficiency of a batch: real tokens / computed tokens.

    Pass one or more arrays whose non-zero entries mark real tokens and whose size is
    the computed shape, e.g. `segment_ids` of a packed or GPT-collated batch, or
    `enc_mask[:, 0]`-style validity vectors for T5 (`loss_mask` of T5 marks the decoder).
    """
    real = sum(int(np.count_nonzero(np.asarray(m))) for m in valid_masks)
    computed = sum(int(np.asarray(m).size) for m in valid_masks)
    return {"real_tokens": real, "computed_tokens": computed,
            "efficiency": real / computed if computed else 0.0}
