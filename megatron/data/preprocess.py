"""Engine of tools/preprocess_data.py: JSON lines -> Megatron .bin/.idx, streaming.

Memory stays flat however big the input is: lines are read lazily in chunks, at most
`2 * workers` chunks are in flight, and results are written (in input order) as soon
as they arrive.  Each chunk is tokenized with one batched tokenizer call and written
with one numpy write per key, which is where the speed over a one-document-at-a-time
loop comes from (see benchmarks/bench_preprocess.py).

Partitions (--partitions P) cut the input into P contiguous byte ranges (whole files
for .gz), process them in parallel, each with workers/P processes, and merge the part
outputs in order, so the result is identical to a single-partition run.
"""
from __future__ import annotations

import collections
import glob
import gzip
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from .indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path, merge_datasets, optimal_dtype


class PreprocessError(RuntimeError):
    """Bad input or arguments; the message names the file:line or flag."""


@dataclass
class Options:
    inputs: list[str]
    output_prefix: str
    json_keys: list[str]
    tokenizer_kwargs: dict
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    workers: int = 1
    partitions: int = 1
    log_interval: int = 1000
    skip_bad_lines: bool = False
    chunk_lines: int = 256
    progress: bool = True


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    bad_lines: int = 0
    bad_examples: list = field(default_factory=list)


# ----------------------------------------------------------------------------- input

def expand_inputs(patterns: list[str]) -> list[str]:
    """--input accepts files or globs; the result keeps pattern order, sorted within a glob."""
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if any(c in pat for c in "*?[") else [pat]
        if not hits:
            raise PreprocessError(f"--input {pat}: no file matches")
        for f in hits:
            if not os.path.exists(f) or os.path.isdir(f):  # pipes are fine (streaming)
                raise PreprocessError(f"--input {f}: no such file")
            files.append(f)
    return files


@dataclass
class Unit:
    """A contiguous piece of one input file: bytes [start, end), first line number."""
    path: str
    start: int = 0
    end: Optional[int] = None  # None: read to the end (gzip, pipes)
    first_line: int = 1
    gz: bool = False


def _line_start_after(f, pos: int) -> int:
    """Offset of the first line starting at or after byte `pos`."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    f.readline()  # finish the line containing pos-1
    return f.tell()


def _count_newlines(path: str, start: int, end: int) -> int:
    n, left = 0, end - start
    with open(path, "rb") as f:
        f.seek(start)
        while left > 0:
            buf = f.read(min(left, 1 << 24))
            if not buf:
                break
            n += buf.count(b"\n")
            left -= len(buf)
    return n


def plan_partitions(files: list[str], partitions: int) -> list[list[Unit]]:
    """Split the inputs into `partitions` groups of contiguous units of similar size."""
    units = []
    for f in files:
        seekable = os.path.isfile(f) and not f.endswith(".gz")
        units.append(Unit(f, 0, os.path.getsize(f) if seekable else None, gz=f.endswith(".gz")))
    if partitions <= 1:
        return [units]
    total = sum(os.path.getsize(u.path) for u in units)
    target = total / partitions
    # Cut plain files at line boundaries so every partition gets about `target` bytes.
    cut: list[Unit] = []
    budget = target
    for u in units:
        if u.end is None:  # gzip cannot be cut without decompressing; keep whole
            cut.append(u)
            budget -= os.path.getsize(u.path)
            if budget <= 0:
                budget = target
            continue
        start = 0
        with open(u.path, "rb") as fh:
            while u.end - start > budget > 0 and len(cut) < 4 * partitions:
                stop = _line_start_after(fh, start + int(budget))
                if stop >= u.end:
                    break
                cut.append(Unit(u.path, start, stop))  # plain file piece
                start, budget = stop, target
            cut.append(Unit(u.path, start, u.end))
            budget -= u.end - start
            if budget <= 0:
                budget = target
    # Line numbers for error messages: one pass over each file, piece by piece.
    for prev, u in zip([None] + cut[:-1], cut):
        if u.start == 0:
            u.first_line = 1
        else:  # the previous unit is the piece of the same file just before this one
            u.first_line = prev.first_line + _count_newlines(u.path, prev.start, u.start)
    # Greedy contiguous grouping by size.
    groups: list[list[Unit]] = [[] for _ in range(partitions)]
    sizes = [(u.end if u.end is not None else max(os.path.getsize(u.path), 1)) - u.start for u in cut]
    acc, g = 0.0, 0
    for u, s in zip(cut, sizes):
        if acc >= target * (g + 1) - 1e-9 and g < partitions - 1 and groups[g]:
            g += 1
        groups[g].append(u)
        acc += s
    return [grp for grp in groups if grp]


def read_lines(units: list[Unit]) -> Iterator[tuple[str, int, bytes]]:
    """Yield (path, line number, raw line) over the units, lazily."""
    for u in units:
        lineno = u.first_line
        try:
            if u.gz:
                fh = gzip.open(u.path, "rb")
            else:
                fh = open(u.path, "rb")
                if u.start:
                    fh.seek(u.start)
            pos = u.start
            with fh:
                for line in fh:
                    if u.end is not None and pos >= u.end:
                        break
                    pos += len(line)
                    yield u.path, lineno, line
                    lineno += 1
        except (OSError, EOFError) as exc:  # corrupt/truncated gzip, unreadable file
            raise PreprocessError(f"{u.path}:{lineno}: cannot read input ({exc})") from None


def chunked(lines, n: int):
    chunk = []
    for item in lines:
        chunk.append(item)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------- encode

_state: dict = {}


def _init_worker(opts: Options, in_pool: bool = False, tokenizer=None) -> None:
    from megatron.tokenizer import build_tokenizer
    if in_pool:
        # Parallelism comes from the worker processes; tokenizer thread pools on top
        # would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Ctrl-C is handled once, by the writing process, which aborts the outputs and
        # terminates the pool (workers would otherwise each print a traceback).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool.terminate() must not raise inside workers
    if tokenizer is None and _state.get("kwargs") == opts.tokenizer_kwargs:
        tokenizer = _state["tok"]  # inherited through fork: no second 0.3 s vocab load
    _state["opts"] = opts
    _state["tok"] = tokenizer if tokenizer is not None else build_tokenizer(**opts.tokenizer_kwargs)
    _state["kwargs"] = opts.tokenizer_kwargs


def _parse(path, lineno, raw, keys):
    try:
        obj = json.loads(raw)
    except RecursionError:
        return None, f"{path}:{lineno}: JSON nested too deeply to be a document"
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        hint = ("; input must be JSON lines (one object per line), not a JSON array"
                if raw.lstrip()[:1] == b"[" else "")
        return None, f"{path}:{lineno}: invalid JSON ({exc.msg if hasattr(exc, 'msg') else exc}){hint}"
    if not isinstance(obj, dict):
        hint = "; input must be JSON lines (one object per line), not a JSON array" if isinstance(obj, list) else ""
        return None, f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}{hint}"
    for k in keys:
        if k not in obj:
            return None, f"{path}:{lineno}: missing key {k!r} (--json-keys {' '.join(keys)})"
        if not isinstance(obj[k], str):
            return None, f"{path}:{lineno}: key {k!r} is {type(obj[k]).__name__}, expected a string"
    return obj, None


def _parse_chunk(chunk, keys, skip_bad: bool):
    """JSON objects of the non-blank lines of a chunk, plus error strings.

    Fast path: the whole chunk is parsed by one C-level json.loads call as a JSON array
    (per-line calls cost more than the tokenizer for short documents).  It is accepted
    only if it yields exactly one valid object per line; otherwise every line is parsed
    on its own so errors carry the exact file:line.
    """
    lines = [(path, lineno, raw) for path, lineno, raw in chunk if raw.strip()]
    try:
        objs = json.loads(b"[" + b",".join(raw for _, _, raw in lines) + b"]")
        if len(objs) == len(lines) and all(
                type(o) is dict and all(type(o.get(k)) is str for k in keys) for o in objs):
            return objs, []
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        pass
    docs, bad = [], []
    for path, lineno, raw in lines:
        obj, err = _parse(path, lineno, raw, keys)
        if err:
            bad.append(err)
            if not skip_bad:
                break  # the run stops anyway; no need to look further
            continue
        docs.append(obj)
    return docs, bad


def _pack_documents(ids: list, eod) -> tuple:
    """One sequence per document: (tokens, sequence lengths, sequences per document).
    Empty documents get no sequence; eod (if not None) ends every non-empty one."""
    n = len(ids)
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=n)
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lens.sum()))
    nonempty = lens > 0
    if eod is not None and n:
        tokens = np.insert(tokens, np.cumsum(lens)[nonempty], eod)
        lens = lens + nonempty
    return tokens, lens[nonempty].astype(np.int32), nonempty.astype(np.int64)


def encode_chunk(chunk):
    """Parse and tokenize one chunk of lines.  Returns (per-key arrays, n_docs, n_bytes, bad)."""
    opts: Options = _state["opts"]
    tok = _state["tok"]
    nbytes = sum(len(raw) for _, _, raw in chunk)
    docs, bad = _parse_chunk(chunk, opts.json_keys, opts.skip_bad_lines)
    if bad and not opts.skip_bad_lines:
        return {}, 0, nbytes, bad
    out = {}
    eod = tok.eod if opts.append_eod else None
    for key in opts.json_keys:
        if not opts.split_sentences:
            texts = [d[key] for d in docs]
            out[key] = _pack_documents(tok.tokenize_batch(texts) if texts else [], eod)
            continue
        from .sentence_split import split_sentences
        pieces = [split_sentences(d[key], opts.lang, opts.keep_newlines) for d in docs]
        flat = [s for p in pieces for s in p]
        ids = tok.tokenize_batch(flat) if flat else []
        seqs_out, lengths, counts, it = [], [], [], iter(ids)
        for p in pieces:
            seqs = [s for s in (next(it) for _ in p) if len(s) > 0]  # Megatron drops empty sentences
            if seqs and eod is not None:
                seqs[-1] = list(seqs[-1]) + [eod]
            seqs_out.extend(seqs)
            lengths.extend(len(s) for s in seqs)
            counts.append(len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs_out), dtype=np.int64, count=sum(lengths))
        out[key] = (tokens, np.asarray(lengths, np.int32), np.asarray(counts, np.int64))
    return out, len(docs), nbytes, bad


# ----------------------------------------------------------------------------- write

def output_prefix_for(prefix: str, key: str, split_sentences: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def run_partition(opts: Options, units: list[Unit], prefix: str, workers: int,
                  position: int = 0) -> Stats:
    """Tokenize `units` into `{prefix}_{key}_{level}.bin/.idx`; all-or-nothing."""
    from megatron.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(**opts.tokenizer_kwargs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(bin_path(output_prefix_for(prefix, k, opts.split_sentences)), dtype)
                for k in opts.json_keys}
    stats = Stats()
    pool = None
    try:
        chunks = chunked(read_lines(units), opts.chunk_lines)
        _init_worker(opts, tokenizer=tokenizer)
        if workers > 1:
            pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(opts, True))
            results = _bounded_imap(pool, chunks, 2 * workers)
        else:
            results = map(encode_chunk, chunks)
        progress = _Progress(opts, stats, position)
        for per_key, ndocs, nbytes, bad in results:
            if bad:
                stats.bad_lines += len(bad)
                stats.bad_examples.extend(bad[: max(0, 10 - len(stats.bad_examples))])
                if not opts.skip_bad_lines:
                    raise PreprocessError(
                        f"{bad[0]}\n(pass --skip-bad-lines to skip and count malformed lines)")
            for k, (tokens, lengths, counts) in per_key.items():
                builders[k].add_documents(tokens, lengths, counts)
                stats.tokens += int(tokens.size)
            stats.documents += ndocs
            stats.bytes += nbytes
            progress.update(ndocs)
        progress.close()
        for k, b in builders.items():
            b.finalize(idx_path(output_prefix_for(prefix, k, opts.split_sentences)))
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return stats


def _bounded_imap(pool, chunks, max_inflight: int):
    """Ordered results with at most `max_inflight` chunks queued (Pool.imap would read
    the whole input ahead, which is what exhausts memory on very large files)."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(encode_chunk, (chunk,)))
        if len(pending) >= max_inflight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Progress:
    """tqdm bar (documents/s, MB/s) on a terminal, plus a log line every --log-interval docs."""

    def __init__(self, opts: Options, stats: Stats, position: int):
        self.opts, self.stats, self.t0, self.next_log = opts, stats, time.time(), opts.log_interval
        self.bar = None
        if opts.progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(unit="doc", desc=f"part {position}" if position else "preprocess",
                            position=position, leave=True, dynamic_ncols=True)

    def update(self, n: int) -> None:
        dt = max(time.time() - self.t0, 1e-9)
        mbs = self.stats.bytes / dt / 1e6
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(f"{mbs:.2f} MB/s", refresh=False)
        elif self.opts.log_interval and self.stats.documents >= self.next_log:
            print(f"processed {self.stats.documents} documents ({self.stats.documents / dt:.0f} docs/s, "
                  f"{mbs:.2f} MB/s)", file=sys.stderr, flush=True)
            while self.next_log <= self.stats.documents:
                self.next_log += self.opts.log_interval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _partition_main(opts, units, prefix, workers, position, queue):
    try:
        queue.put(("ok", run_partition(opts, units, prefix, workers, position)))
    except KeyboardInterrupt:
        queue.put(("error", "interrupted"))
    except BaseException as exc:  # reported by the parent, which exits non-zero
        queue.put(("error", str(exc)))


def preprocess(opts: Options) -> Stats:
    """Run the whole job; returns the totals.  Raises PreprocessError on bad input."""
    if opts.workers < 1:
        raise PreprocessError("--workers must be >= 1")
    if opts.partitions < 1 or opts.workers % opts.partitions:
        raise PreprocessError(f"--workers ({opts.workers}) must be a multiple of --partitions ({opts.partitions})")
    if opts.split_sentences:
        from .sentence_split import load_punkt
        load_punkt(opts.lang)  # fail fast on an unshipped --lang
    out_dir = os.path.dirname(os.path.abspath(opts.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    files = expand_inputs(opts.inputs)
    groups = plan_partitions(files, opts.partitions)
    if len(groups) == 1:
        return run_partition(opts, groups[0], opts.output_prefix, opts.workers)
    per = opts.workers // opts.partitions
    parts = [f"{opts.output_prefix}.part{i}" for i in range(len(groups))]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_partition_main, args=(opts, g, p, per, i + 1, queue))
             for i, (g, p) in enumerate(zip(groups, parts))]
    try:
        for p in procs:
            p.start()
        results = []
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=1.0))
            except Exception:  # queue.Empty: check that nobody died without reporting
                if not any(p.is_alive() for p in procs) and queue.empty():
                    raise PreprocessError("a partition process died without reporting (killed? out of memory?)")
        for p in procs:
            p.join()
        errors = [msg for status, msg in results if status == "error"]
        if errors:
            raise PreprocessError(errors[0])
        total = Stats()
        for _, s in results:
            total.documents += s.documents
            total.tokens += s.tokens
            total.bytes += s.bytes
            total.bad_lines += s.bad_lines
            total.bad_examples.extend(s.bad_examples)
        for k in opts.json_keys:
            merge_datasets([output_prefix_for(p, k, opts.split_sentences) for p in parts],
                           output_prefix_for(opts.output_prefix, k, opts.split_sentences))
        return total
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        for part in parts:
            for k in opts.json_keys:
                base = output_prefix_for(part, k, opts.split_sentences)
                for path in (bin_path(base), idx_path(base), bin_path(base) + ".tmp"):
                    if os.path.exists(path):
                        os.remove(path)
