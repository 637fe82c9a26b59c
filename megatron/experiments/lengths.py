"""Sample lengths for simulated batches.

Default: the real (input, target) token lengths of the shipped multi-task set
(`data/multitask/kjv_tasks.jsonl.gz`, tokenized with the shipped SentencePiece model
`data/tokenizers/kjv_sp4k.model`), cached as `experiments/cache/kjv_tasks_sp4k_lengths.txt`.
The KJV tasks are short (longest GPT sample 1.1k tokens), so for a max length L every length
is scaled by L / (longest sample): the mixture's shape is kept and its longest sample is L
long. A lengths file (`--lengths-file`, or `lengths_file` in the grid) replaces the set: one
sample per line, "input target" (two integers) or one integer (GPT; T5 then uses a
1-token target); it is scaled the same way.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from megatron.atomic import write_text
from megatron.experiments.config import ROOT

DATA = ROOT / "data" / "multitask" / "kjv_tasks.jsonl.gz"
TOKENIZER = ROOT / "data" / "tokenizers" / "kjv_sp4k.model"
CACHE = ROOT / "experiments" / "cache" / "kjv_tasks_sp4k_lengths.txt"


def _tokenize_shipped() -> np.ndarray:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for line in f]
    ins = sp.encode([r["inputs"] for r in rows])
    outs = sp.encode([r["targets"] for r in rows])
    return np.array([[len(a), len(b)] for a, b in zip(ins, outs)], dtype=np.int64)


def read_lengths_file(path) -> np.ndarray:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            try:
                vals = [int(x) for x in parts]
            except ValueError:
                raise ValueError(f"{path}:{n}: expected one or two integers, got {line.strip()!r}") from None
            if len(vals) not in (1, 2) or min(vals) < 1:
                raise ValueError(f"{path}:{n}: expected one or two positive integers, got {line.strip()!r}")
            out.append(vals if len(vals) == 2 else [vals[0], 1])
    if not out:
        raise ValueError(f"{path}: no lengths")
    return np.array(out, dtype=np.int64)


def load_lengths(path: Optional[str] = None) -> np.ndarray:
    """(N, 2) array of (input, target) lengths."""
    if path:
        p = Path(path)
        return read_lengths_file(p if p.is_file() else ROOT / path)
    if CACHE.is_file():
        return read_lengths_file(CACHE)
    arr = _tokenize_shipped()
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    write_text(CACHE, "# (input, target) SentencePiece lengths of data/multitask/kjv_tasks.jsonl.gz\n"
               + "\n".join(f"{a} {b}" for a, b in arr) + "\n")
    return arr


def draw_batches(pairs: np.ndarray, kind: str, max_len: int, tokens: int, n: int, seed: int) -> List[list]:
    """`n` global batches: samples drawn uniformly (with replacement) from the scaled set and
    added until the next one would exceed the token budget. GPT samples are input + target
    (one int), T5 samples (input, target) pairs, each side truncated to max_len."""
    total = pairs.sum(axis=1)
    scale = max_len / float(total.max() if kind == "gpt" else pairs.max())
    scaled = np.maximum(1, np.round(pairs * scale)).astype(np.int64)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n):
        batch, used = [], 0
        while True:
            i, t = scaled[rng.integers(len(scaled))]
            if kind == "gpt":
                sample, cost = min(max_len, int(i + t)), min(max_len, int(i + t))
            else:
                sample = (min(max_len, int(i)), min(max_len, int(t)))
                cost = sum(sample)
            if used + cost > tokens:
                break
            batch.append(sample)
            used += cost
        if not batch:
            raise ValueError(f"token budget {tokens} is smaller than one sample of max length {max_len}")
        batches.append(batch)
    return batches
