"""GPT-2 byte-level BPE, written from the published algorithm (Radford et al. 2019).

Text is split by GPT-2's regex into words; each word's UTF-8 bytes are mapped to
printable unicode characters (so every byte has a symbol and nothing is ever unknown),
then adjacent symbol pairs are merged greedily by merge rank until no ranked pair is
left.  This pure-Python encoder is the reference; `GPT2BPETokenizer` can hand batches
to the HF `tokenizers` Rust implementation of the same algorithm for speed, and the
tests check both give identical ids.
"""
from __future__ import annotations

import gzip
import json
from functools import lru_cache

import regex

# GPT-2's pre-tokenisation pattern: English contractions, letter runs, digit runs,
# other-symbol runs (each optionally with one leading space), and whitespace runs
# (the last space of a run stays attached to the next word).
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """Bijection byte -> printable character: printable Latin-1 bytes map to themselves,
    the remaining 68 bytes to code points 256.. in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def open_text(path: str):
    """Open a text file, transparently gunzipping `*.gz` (the shipped vocab is compressed)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def load_vocab_and_merges(vocab_file: str, merge_file: str):
    """Read GPT-2's encoder.json (token -> id) and vocab.bpe (one merge per line)."""
    with open_text(vocab_file) as f:
        try:
            encoder = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 JSON vocabulary ({exc})") from None
        except RecursionError:
            raise ValueError(f"--vocab-file {vocab_file}: JSON nested too deeply (not a GPT-2 vocabulary)") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--vocab-file {vocab_file}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             f"not a GPT-2 JSON vocabulary") from None
    # token -> id, ids distinct and dense enough: a forged id of 10**12 must not size a table.
    if not isinstance(encoder, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 * len(encoder) + 1024
            for k, v in encoder.items()) or len(set(encoder.values())) != len(encoder):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> distinct id in "
                         f"[0, {2 * len(encoder) + 1024 if isinstance(encoder, dict) else 0}), not a GPT-2 vocabulary")
    merges = []
    lineno = 0
    try:
        with open_text(merge_file) as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"--merge-file {merge_file}:{lineno}: expected two symbols, got {line[:80]!r}")
                merges.append((parts[0], parts[1]))
    except (UnicodeDecodeError, EOFError, OSError) as exc:  # binary, or a truncated .gz
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"--merge-file {merge_file}: unreadable after line {lineno} ({exc}); expected GPT-2's "
                         f"vocab.bpe text, one merge per line") from None
    return encoder, merges


class ByteLevelBPE:
    """The reference GPT-2 encoder/decoder (pure Python, cached per word)."""

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]]):
        self.encoder = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[str]:
        symbols = list(word)
        while len(symbols) > 1:
            # The lowest-ranked adjacent pair merges first, everywhere it occurs.
            best = min(zip(symbols, symbols[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids = [self.encoder[s] for s in self._bpe(mapped)]
            if len(self._cache) < 200_000:  # bound memory on adversarial input
                self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word in GPT2_PATTERN.findall(text):
            out.extend(self.encode_word(word))
        return out

    def decode(self, ids) -> str:
        data = bytearray()
        for i in ids:
            data.extend(self.byte_decoder[c] for c in self.decoder[int(i)])
        return data.decode("utf-8", errors="replace")
