"""Megatron's mmap indexed dataset: a `.bin` token stream plus an `.idx` index.

Byte layout of `.idx` (little-endian), identical to what Megatron-LM writes and reads:

    offset 0   magic            b"MMIDIDX\\x00\\x00"   (9 bytes)
    offset 9   version          <Q  = 1
    offset 17  dtype code       <B  (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16)
    offset 18  sequence_count   <Q
    offset 26  document_count   <Q  (number of documents + 1)
    offset 34  sequence_lengths   int32[sequence_count]
               sequence_pointers  int64[sequence_count]  (byte offsets into .bin, all checked at open)
               document_indices   int64[document_count]  (0, then the end sequence of each doc)

`.bin` has no header: the tokens of every sequence, back to back, in the index dtype.
A document is one or more sequences (sentences with --split-sentences).

Writes are crash-safe: the builder writes `<file>.tmp` and renames both files only in
`finalize`, so an interrupted run never leaves an `.idx` that looks valid.
"""
from __future__ import annotations

import array
import os
import struct
from typing import Iterable, Optional

import numpy as np

from megatron import safe_paths

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_SIZE = 34

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated, foreign or inconsistent."""


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every token id fits (Megatron's 65,500 cut-off), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    """True if both files of the dataset `prefix` exist."""
    return os.path.exists(idx_path(prefix)) and os.path.exists(bin_path(prefix))


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise IndexedDatasetError(f"dtype {np.dtype(dtype)} has no Megatron .idx code") from None


def _regular(path: str, what: str) -> None:
    """A data path may be a link (datasets are often linked in), but must end at a regular file:
    a FIFO or a device (/dev/zero) is refused from stat, before it is opened or mapped."""
    try:
        safe_paths.regular_path(path, what)
    except safe_paths.UnsafePathError as e:
        raise IndexedDatasetError(str(e)) from None


class _Index:
    """Parsed and validated `.idx` file (arrays are views into an mmap)."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise IndexedDatasetError(f"{path}: index file not found")
        _regular(path, "index file")
        file_size = os.path.getsize(path)
        if file_size < _HEADER_SIZE:
            raise IndexedDatasetError(
                f"{path}: truncated header ({file_size} bytes, need {_HEADER_SIZE})")
        with open(path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if header[:9] != _MAGIC:
            raise IndexedDatasetError(
                f"{path}: not a Megatron mmap index (magic {header[:9]!r}, expected {_MAGIC!r}); "
                "legacy TNTIDX/lazy files must be re-preprocessed")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != _VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version} (expected 1)")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        expected = _HEADER_SIZE + self.sequence_count * (4 + 8) + self.document_count * 8
        # Multimodal indices append one int8 mode per sequence; accept that extra tail.
        if file_size not in (expected, expected + self.sequence_count):
            raise IndexedDatasetError(
                f"{path}: size {file_size} bytes does not match its header "
                f"({self.sequence_count} sequences, {self.document_count} document entries "
                f"-> {expected} bytes); the file is truncated or corrupt")
        self._mmap = np.memmap(path, mode="r", dtype=np.uint8)
        off = _HEADER_SIZE
        n, d = self.sequence_count, self.document_count
        self.sequence_lengths = np.frombuffer(self._mmap, np.int32, n, off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(self._mmap, np.int64, n, off)
        off += 8 * n
        self.document_indices = np.frombuffer(self._mmap, np.int64, d, off)
        doc = self.document_indices
        if n and int(self.sequence_lengths.min()) < 0:
            raise IndexedDatasetError(f"{path}: negative sequence length in the index (corrupt or forged index)")
        # Megatron's builder always ends the last document at sequence_count, but files
        # written by other scripts may leave trailing sequences outside any document.
        if d == 0 or doc[0] != 0 or doc[-1] > n or (d > 1 and bool((np.diff(doc) < 0).any())):
            raise IndexedDatasetError(
                f"{path}: document_indices must start at 0, never decrease and stay <= {n}")
        check_pointers(path, self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize)


_CHUNK = 1 << 22  # entries per vectorised pass: bounds the temporary to 32 MiB whatever the file


def check_pointers(path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> None:
    """Every sequence pointer must be where the lengths before it put it (the .bin holds the
    sequences back to back, as Megatron's builder writes them): one vectorised pass over the
    whole index at open, in chunks; the first bad entry is named. With the .bin size checked
    against the lengths' sum, every read stays inside the .bin and on its own sequence."""
    start = 0
    for lo in range(0, len(lengths), _CHUNK):
        hi = min(lo + _CHUNK, len(lengths))
        ends = np.cumsum(lengths[lo:hi], dtype=np.int64)
        expected = np.empty(hi - lo, dtype=np.int64)
        expected[0] = start
        expected[1:] = start + ends[:-1]
        expected *= itemsize
        bad = np.flatnonzero(expected != pointers[lo:hi])
        if bad.size:
            i = lo + int(bad[0])
            raise IndexedDatasetError(
                f"{path}: sequence {i} points at byte {int(pointers[i])} of the .bin, but the lengths before it put it "
                f"at byte {int(expected[bad[0]])} (corrupt or forged index; re-run tools/preprocess_data.py)")
        start += int(ends[-1])


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair; `ds[i]` is sequence i as a numpy array.

    `ds[i:j]` returns a list of sequences; `get(i, offset, length)` reads part of one
    sequence without touching the rest (the GPT dataset reads sample windows this way).
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = path_prefix
        self.index = _Index(idx_path(path_prefix))
        bpath = bin_path(path_prefix)
        if not os.path.exists(bpath):
            raise IndexedDatasetError(f"{bpath}: token file not found (index exists)")
        _regular(bpath, "token file")
        itemsize = self.index.dtype.itemsize
        need = int(self.index.sequence_lengths.astype(np.int64).sum()) * itemsize
        have = os.path.getsize(bpath)
        if have != need:
            raise IndexedDatasetError(
                f"{bpath}: {have} bytes but {idx_path(path_prefix)} describes {need} bytes; "
                "the pair is truncated or from different runs, re-run tools/preprocess_data.py")
        if have == 0:
            self._bin = np.zeros(0, dtype=self.index.dtype)
        elif mmap:
            self._bin = np.memmap(bpath, mode="r", dtype=self.index.dtype)
        else:
            self._bin = np.fromfile(bpath, dtype=self.index.dtype)

    # Properties used by the GPT/T5 datasets, named as in Megatron.
    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_documents(self) -> int:
        return len(self.index.document_indices) - 1

    def __len__(self) -> int:
        return int(self.index.sequence_count)

    def require_tokens(self, flag: str = "--data-path") -> "IndexedDataset":
        """Training on an empty dataset fails here, naming the prefix, not deep inside a sampler."""
        if self.num_documents == 0 or int(self.index.sequence_lengths.astype(np.int64).sum()) == 0:
            raise IndexedDatasetError(
                f"{flag} {self.path_prefix}: the dataset holds no tokens ({self.num_documents} documents); "
                "was tools/preprocess_data.py given an empty input?")
        return self

    def _start(self, i: int) -> int:
        return int(self.index.sequence_pointers[i]) // self.index.dtype.itemsize

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            n = len(self)
            if idx < 0:
                idx += n
            if not 0 <= idx < n:
                raise IndexError(f"sequence {idx} out of range for {self.path_prefix} ({n})")
            start = self._start(idx)
            return self._bin[start:start + int(self.index.sequence_lengths[idx])]
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        raise TypeError(f"index must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence idx (to its end if length is None)."""
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        start = self._start(idx) + offset
        return self._bin[start:start + length]


class IndexedDatasetBuilder:
    """Writes a `.bin/.idx` pair incrementally with bounded memory.

    Tokens stream straight to `<bin>.tmp`; only one int32 per sequence and one int64
    per document stay in memory (compact `array` buffers, not Python lists of ints).
    Call `finalize(idx_path)` to commit both files, or `abort()` to delete the partial output.
    """

    def __init__(self, bin_file: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        self.bin_file = bin_file
        self._tmp_bin = bin_file + ".tmp"
        self._out = open(self._tmp_bin, "wb")
        self._lengths = array.array("i")
        self._doc_idx = array.array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if self._info is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = arr.min(), arr.max()
            if lo < self._info.min or hi > self._info.max:
                raise IndexedDatasetError(
                    f"{self.bin_file}: token id {hi if hi > self._info.max else lo} does not fit "
                    f"{self.dtype}; preprocess with a larger dtype (vocab >= 65500 -> int32)")
        self._out.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        self._lengths.append(self._write(tokens))

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens, lengths: Iterable[int]) -> None:
        """Append one document given as a flat token array plus its sequence lengths."""
        lengths = [int(x) for x in lengths]
        arr = np.asarray(tokens)
        if sum(lengths) != arr.size:
            raise IndexedDatasetError(
                f"{self.bin_file}: add_document lengths sum to {sum(lengths)} but got {arr.size} tokens")
        self._write(arr)
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      document_sequence_counts: np.ndarray) -> None:
        """Bulk append: `tokens` is every sequence of several documents back to back,
        `sequence_lengths` their lengths, `document_sequence_counts` the number of
        sequences per document (0 allowed).  One write per call, no Python loop."""
        lengths = np.asarray(sequence_lengths, dtype=np.int32)
        counts = np.asarray(document_sequence_counts, dtype=np.int64)
        if int(lengths.sum(dtype=np.int64)) != np.asarray(tokens).size or int(counts.sum()) != lengths.size:
            raise IndexedDatasetError(f"{self.bin_file}: add_documents got inconsistent lengths")
        self._write(tokens)
        base = len(self._lengths)
        self._lengths.frombytes(lengths.tobytes())
        self._doc_idx.frombytes((np.cumsum(counts) + base).astype(np.int64).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Append a whole finished dataset (merging shards); dtypes must match."""
        other = _Index(idx_path(path_prefix))
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{idx_path(path_prefix)}: dtype {other.dtype} differs from the builder's {self.dtype}")
        offset = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._doc_idx.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        with open(bin_path(path_prefix), "rb") as f:
            while chunk := f.read(1 << 24):  # 16 MiB copies keep memory flat
                self._out.write(chunk)

    def finalize(self, idx_file: str) -> None:
        """Close the token file and write the index; both appear atomically."""
        self._out.close()
        write_index(idx_file + ".tmp", self.dtype, np.frombuffer(self._lengths, np.int32),
                    np.frombuffer(self._doc_idx, np.int64))
        # Drop any old index first and rename .bin before .idx: a reader needs the
        # .idx, so a crash between the steps never leaves a valid-looking mixed pair.
        if os.path.exists(idx_file):
            os.remove(idx_file)
        os.replace(self._tmp_bin, self.bin_file)
        os.replace(idx_file + ".tmp", idx_file)

    def abort(self) -> None:
        """Close and delete the partial output (used on errors and Ctrl-C)."""
        if not self._out.closed:
            self._out.close()
        for p in (self._tmp_bin,):
            if os.path.exists(p):
                os.remove(p)


def write_index(path: str, dtype, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an `.idx` file for sequences of the given lengths (pointers derived)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(_MAGIC)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def merge_datasets(prefixes: list[str], output_prefix: str) -> None:
    """Concatenate several finished datasets into one (documents keep their order)."""
    if not prefixes:
        raise IndexedDatasetError("merge_datasets: no input prefixes")
    dtype = _Index(idx_path(prefixes[0])).dtype
    builder = IndexedDatasetBuilder(bin_path(output_prefix), dtype=dtype)
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(idx_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
