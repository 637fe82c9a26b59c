"""Preprocessing throughput and index-build time; prints one JSON object.

    .venv/bin/python benchmarks/bench_preprocess.py [--repeat 4] [--tokens 1e8]

Measures, on the shipped KJV corpus (data/kjv/kjv.jsonl.gz, replicated --repeat times)
with the GPT-2 tokenizer, both as shipped ("chapters": 1,189 documents of ~3.5 KB) and
one document per verse ("verses": 31,102 documents of ~130 bytes, where per-document
overhead dominates):
  * baseline_python:  one document at a time, pure-Python GPT-2 BPE, one write per
                      document (what a straightforward port of the reference does);
  * baseline_per_doc: one document at a time with the Rust BPE and per-document writes;
  * ours_w1 / ours_w2: megatron.data.preprocess with 1 and 2 workers (batched tokenizer
                      calls, one numpy write per chunk, streaming input);
  * memory: peak RSS of `ours` at 1x and 4x the input size (flat = streaming works);
  * index_build: GPT sample/shuffle index for --tokens tokens (C++ helpers).
Every mode runs in its own subprocess so peak RSS is per mode; modes are interleaved
--trials times and the fastest run of each is reported.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VOCAB = os.path.join(ROOT, "data/gpt2/gpt2-vocab.json.gz")
MERGES = os.path.join(ROOT, "data/gpt2/gpt2-merges.txt.gz")


def _tok_kwargs():
    return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


def run_mode(mode: str, inp: str, out: str) -> dict:
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
    from megatron.tokenizer import build_tokenizer
    t0 = time.perf_counter()
    if mode.startswith("baseline"):
        tok = build_tokenizer(**_tok_kwargs())
        encode = tok.reference.encode if mode == "baseline_python" else tok.tokenize
        builder = IndexedDatasetBuilder(out + ".bin", optimal_dtype(tok.vocab_size))
        docs = tokens = nbytes = 0
        with open(inp, "rb") as f:
            for line in f:
                nbytes += len(line)
                ids = encode(json.loads(line)["text"]) + [tok.eod]
                builder.add_item(np.array(ids))
                builder.end_document()
                docs += 1
                tokens += len(ids)
        builder.finalize(out + ".idx")
    else:
        from megatron.data.preprocess import Options, preprocess
        workers = int(mode.split("_w")[1].split("_")[0])
        stats = preprocess(Options(inputs=[inp], output_prefix=out, json_keys=["text"], tokenizer_kwargs=_tok_kwargs(),
                                   append_eod=True, workers=workers, progress=False))
        docs, tokens, nbytes = stats.documents, stats.tokens, stats.bytes
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"mode": mode, "seconds": round(dt, 3), "documents": docs, "tokens": tokens,
            "docs_per_s": round(docs / dt, 1), "tokens_per_s": round(tokens / dt),
            "mb_per_s": round(nbytes / dt / 1e6, 2), "peak_rss_mb": round(max(peak, peak_children) / 1024, 1)}


def index_build(total_tokens: int, seq_length: int = 2048) -> dict:
    """Time GPTDataset index construction over a synthetic (sparse) 1e8-token dataset."""
    import numpy as np

    from megatron.data.gpt_dataset import GPTDataset
    from megatron.data.indexed_dataset import IndexedDataset, write_index
    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 1800, size=int(total_tokens // 1000) + 1).astype(np.int32)
    lengths = lengths[np.cumsum(lengths, dtype=np.int64) <= total_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "synthetic")
        write_index(prefix + ".idx", np.uint16, lengths, np.arange(len(lengths) + 1))
        with open(prefix + ".bin", "wb") as f:  # sparse file: the index build never reads tokens
            f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        ds = IndexedDataset(prefix)
        n = int(lengths.sum(dtype=np.int64)) // seq_length
        t0 = time.perf_counter()
        gds = GPTDataset(ds, np.arange(len(lengths)), n, seq_length, 1234, data_cache_path=None)
        dt = time.perf_counter() - t0
    return {"tokens": int(lengths.sum()), "documents": len(lengths), "seq_length": seq_length,
            "samples": len(gds), "seconds": round(dt, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2, help="replicate the corpus this many times")
    ap.add_argument("--tokens", type=float, default=1e8, help="tokens for the index-build timing")
    ap.add_argument("--trials", type=int, default=3,
                    help="runs per mode, interleaved; the fastest is reported (shared machines are noisy)")
    ap.add_argument("--_mode", help=argparse.SUPPRESS)
    ap.add_argument("--_input", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._mode:
        print(json.dumps(run_mode(args._mode, args._input, args._out)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        chapters = gzip.open(os.path.join(ROOT, "data/kjv/kjv.jsonl.gz"), "rb").read()
        verses = b"".join(json.dumps({"text": v}).encode() + b"\n"
                          for line in chapters.splitlines() for v in json.loads(line)["text"].split("\n"))
        inputs = {}
        for name, src in (("chapters", chapters), ("verses", verses)):
            for k in (args.repeat, 4 * args.repeat):
                inputs[name, k] = os.path.join(tmp, f"kjv_{name}_x{k}.jsonl")
                with open(inputs[name, k], "wb") as f:
                    for _ in range(k):
                        f.write(src)

        def sub(mode, name, k):
            out = subprocess.run([sys.executable, __file__, "--_mode", mode, "--_input", inputs[name, k],
                                  "--_out", os.path.join(tmp, f"{mode}_{name}_{k}")], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(out.stderr)
            return json.loads(out.stdout.strip().splitlines()[-1])

        report = {"tokenizer": "GPT2BPETokenizer", "cpu_count": os.cpu_count(), "repeat": args.repeat}
        for name in ("chapters", "verses"):
            modes = ("baseline_python", "baseline_per_doc", "ours_w1", "ours_w2")
            results = {}
            for _ in range(args.trials):
                for m in modes:
                    r = sub(m, name, args.repeat)
                    if m not in results or r["seconds"] < results[m]["seconds"]:
                        results[m] = r
            big = sub("ours_w1", name, 4 * args.repeat)
            best = max(results["ours_w1"]["docs_per_s"], results["ours_w2"]["docs_per_s"])
            report[name] = {
                "documents": results["ours_w1"]["documents"], "results": results,
                "speedup_vs_baseline_python": round(best / results["baseline_python"]["docs_per_s"], 2),
                "speedup_vs_baseline_per_doc": round(best / results["baseline_per_doc"]["docs_per_s"], 2),
                "memory_flat": {f"peak_rss_mb_x{args.repeat}": results["ours_w1"]["peak_rss_mb"],
                                f"peak_rss_mb_x{4 * args.repeat}": big["peak_rss_mb"]},
            }
        report["index_build"] = index_build(int(args.tokens))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
