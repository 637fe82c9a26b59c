"""Input files checked before any process group or model exists: data prefixes, tokenizer files,
and whether the tokenizer can have written the data's token ids.

Every rank runs the same checks on the same files (cheap: the token files are memory-mapped),
so every rank exits with status 2 together; only rank 0 prints the one line.
"""
from __future__ import annotations

import difflib
import glob
import os
from typing import Optional, Sequence

import numpy as np

from megatron.config.core import ConfigError, MegatronConfig

# A token file up to this many tokens is scanned whole (a few hundred MB at most: well under a
# second from the page cache). A larger one is sampled: SAMPLE_WINDOWS evenly spaced windows of
# SAMPLE_WINDOW tokens, plus its last window. A mismatched tokenizer puts out-of-range ids all over
# a corpus, so a 16M-token sample finds them; a handful of stray ids in a huge file can slip by.
FULL_SCAN_TOKENS = 64 * 2 ** 20
SAMPLE_WINDOWS = 256
SAMPLE_WINDOW = 64 * 2 ** 10
_CHUNK = 16 * 2 ** 20


def token_id_range(tokens: np.ndarray) -> tuple[int, int, int]:
    """(min id, max id, tokens read) of a memory-mapped token array: whole or sampled (see above)."""
    n = int(tokens.shape[0])
    if n == 0:
        return 0, -1, 0
    if n <= FULL_SCAN_TOKENS:
        spans = [(s, min(n, s + _CHUNK)) for s in range(0, n, _CHUNK)]
    else:
        starts = np.linspace(0, n - SAMPLE_WINDOW, SAMPLE_WINDOWS).astype(np.int64)
        spans = [(int(s), int(s) + SAMPLE_WINDOW) for s in starts]
    lo, hi, read = None, None, 0
    for a, b in spans:
        part = tokens[a:b]
        pmin, pmax = int(part.min()), int(part.max())
        lo = pmin if lo is None else min(lo, pmin)
        hi = pmax if hi is None else max(hi, pmax)
        read += b - a
    return lo, hi, read


def _suggest(prefix: str) -> str:
    """' (did you mean X?)' for a close existing prefix in the same folder, else ''."""
    folder = os.path.dirname(prefix) or "."
    if not os.path.isdir(folder):
        if os.path.normpath(folder).endswith(os.path.join("data", "cache")):
            return f" (folder {folder} does not exist: `bash data/build_sample_data.sh` builds the sample data)"
        return f" (folder {folder} does not exist)"
    have = [p[:-4] for p in glob.glob(os.path.join(folder, "*.idx"))]
    close = difflib.get_close_matches(prefix, have, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def check_data_prefix(flag: str, prefix: str):
    """The IndexedDataset behind one --data-path / --targets-data-path prefix, or ConfigError."""
    from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, bin_path, idx_path
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            raise ConfigError(f"{flag} {prefix}: give the prefix of the .bin/.idx pair, without the suffix: "
                              f"{flag} {prefix[:-len(suffix)]}")
    missing = [p for p in (bin_path(prefix), idx_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"{flag} {prefix}: {' and '.join(missing)} not found{_suggest(prefix)}; the flag takes "
                          "the prefix of a .bin/.idx pair written by tools/preprocess_data.py")
    try:
        return IndexedDataset(prefix).require_tokens(flag)
    except IndexedDatasetError as e:
        raise ConfigError(f"{flag} {prefix}: {e}") from None


def _tokenizer_flags(cfg: MegatronConfig) -> str:
    d = cfg.data
    if d.tokenizer_type is None:
        return f"--vocab-size {cfg.model.vocab_size}"
    parts = [f"--tokenizer-type {d.tokenizer_type}"]
    for flag, value in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file),
                        ("--tokenizer-model", d.tokenizer_model), ("--vocab-extra-ids", d.vocab_extra_ids or None)):
        if value is not None:
            parts.append(f"{flag} {value}")
    if d.tokenizer_type == "NullTokenizer":
        parts.append(f"--vocab-size {cfg.model.vocab_size}")
    return " ".join(parts)


def check_vocabulary(flag: str, dataset, vocab_size: Optional[int], tokenizer_flags: str) -> None:
    """Refuse data whose token ids the tokenizer (or --vocab-size) cannot have produced."""
    if vocab_size is None:
        return
    dtype = np.dtype(dataset.dtype)
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return  # every id this dtype can hold is in range
    from megatron.data.indexed_dataset import bin_path
    path = bin_path(dataset.path_prefix)
    tokens = np.memmap(path, mode="r", dtype=dtype) if os.path.getsize(path) else np.zeros(0, dtype)
    lo, hi, read = token_id_range(tokens)
    if hi < vocab_size and lo >= 0:
        return
    n = int(tokens.shape[0])
    how = f"all {n} tokens checked" if read == n else f"{read} of {n} tokens sampled"
    bad = f"max token id {hi} >= the vocabulary size {vocab_size}" if hi >= vocab_size else f"token id {lo} < 0"
    raise ConfigError(f"{flag} {dataset.path_prefix}: {bad} of {tokenizer_flags} ({how}); the data was "
                      "tokenized with another tokenizer: pass the one tools/preprocess_data.py used, or re-run it "
                      "with this one")


def _prefixes(data_path: Sequence[str]) -> list:
    from megatron.data.blended_dataset import parse_data_path
    try:
        return parse_data_path(data_path)[0]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_inputs(cfg: MegatronConfig) -> None:
    """Raise ConfigError (one line) for a missing or mismatched data or tokenizer file."""
    from megatron.training.pretrain import tokenizer_from_config
    d = cfg.data
    try:
        tokenizer = tokenizer_from_config(cfg)
    except (OSError, ValueError, ImportError) as e:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(text if text.startswith("--") else f"--tokenizer-type {d.tokenizer_type}: {text}") from None
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.vocab_size
    for flag, path, used in (("--dynapipe-cost-model", d.dynapipe_cost_model, d.dynapipe),
                             ("--terapipe-cost-model", cfg.terapipe.cost_model, cfg.terapipe.enabled)):
        if used and path and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: file not found (cost_models/ holds the shipped ones)")
    from megatron.cli.flag_checks import load_folder_hint
    hint = load_folder_hint(cfg.checkpoint.load)
    if hint:
        raise ConfigError(hint)
    if d.mock_data:
        return
    flags = _tokenizer_flags(cfg)
    for flag, paths in (("--data-path", d.data_path), ("--targets-data-path", d.targets_data_path)):
        if not paths:
            continue
        for prefix in _prefixes(paths):
            check_vocabulary(flag, check_data_prefix(flag, prefix), vocab, flags)


def check_inputs_or_exit(cfg: MegatronConfig) -> None:
    """`check_inputs`, reported as one line with exit status 2 (entry points call this)."""
    from megatron.cli.arguments import exit_with_error
    try:
        check_inputs(cfg)
    except ConfigError as e:
        exit_with_error(cfg.model.model_type, e)
