"""tools/preprocess_data.py end to end: outputs decode back to the input text."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.preprocess import Options, plan_partitions, preprocess
from megatron.tokenizer import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(ROOT, "data", "gpt2", "gpt2-vocab.json.gz")
MERGES = os.path.join(ROOT, "data", "gpt2", "gpt2-merges.txt.gz")
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = "the LORD said unto Moses . é 東京 🙂 \n 42 don't".split(" ")
    return [{"text": " ".join(rng.choice(words, rng.integers(0, 40))), "id": i} for i in range(n)]


def _write(path, docs, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def _run(args, **kw):
    return subprocess.run([sys.executable, TOOL, "--no-progress", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_end_to_end_workers_partitions_glob(tmp_path):
    docs = _docs(700)
    _write(tmp_path / "in_a.jsonl", docs[:300])
    _write(tmp_path / "in_b.jsonl.gz", docs[300:500], gz=True)
    _write(tmp_path / "in_c.json", docs[500:])
    out = str(tmp_path / "out" / "kjv")
    r = _run(["--input", str(tmp_path / "in_*"), *GPT2, "--append-eod", "--workers", "2", "--partitions", "2",
              "--chunk-lines", "16", "--output-prefix", out])
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(out + "_text_document")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    assert ds.dtype == np.uint16
    nonempty = [d for d in docs if d["text"]]
    assert ds.num_documents == len(docs) and len(ds) == len(nonempty)  # empty docs have no sequence
    for seq, d in zip((ds[i] for i in range(len(ds))), nonempty):
        assert seq[-1] == tok.eod and tok.detokenize(seq[:-1]) == d["text"]
    assert sorted(os.listdir(tmp_path / "out")) == ["kjv_text_document.bin", "kjv_text_document.idx"]
    # Same bytes as one worker, one partition (order and content preserved).
    r1 = _run(["--input", str(tmp_path / "in_*"), *GPT2, "--append-eod", "--output-prefix", out + "1"])
    assert r1.returncode == 0, r1.stderr
    for ext in (".bin", ".idx"):
        assert open(out + "_text_document" + ext, "rb").read() == open(out + "1_text_document" + ext, "rb").read()


def test_partition_plan_cuts_at_lines(tmp_path):
    _write(tmp_path / "a.jsonl", _docs(100))
    groups = plan_partitions([str(tmp_path / "a.jsonl")], 3)
    assert len(groups) == 3
    lines = open(tmp_path / "a.jsonl", "rb").read().split(b"\n")[:-1]
    units = [u for g in groups for u in g]
    assert units[0].start == 0 and all(a.end == b.start for a, b in zip(units, units[1:]))
    for u in units:
        assert u.first_line == 1 + open(tmp_path / "a.jsonl", "rb").read()[:u.start].count(b"\n")
    assert sum(1 for _ in lines) == 100


def test_split_sentences_and_multiple_keys(tmp_path):
    rows = [{"inputs": "Dr. Smith came. He saw the LORD. It was good.", "targets": "Yes. No."},
            {"inputs": "One sentence only", "targets": ""}]
    _write(tmp_path / "t.jsonl", rows)
    opts = Options(inputs=[str(tmp_path / "t.jsonl")], output_prefix=str(tmp_path / "o"), json_keys=["inputs", "targets"],
                   tokenizer_kwargs=dict(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES),
                   split_sentences=True, append_eod=True, progress=False)
    stats = preprocess(opts)
    assert stats.documents == 2
    inp = IndexedDataset(str(tmp_path / "o_inputs_sentence"))
    tgt = IndexedDataset(str(tmp_path / "o_targets_sentence"))
    assert inp.document_indices.tolist() == [0, 3, 4] and tgt.document_indices.tolist() == [0, 2, 2]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    assert tok.detokenize(inp[0]) == "Dr. Smith came." and inp[2][-1] == tok.eod


def test_bad_line_stops_with_location(tmp_path):
    good = [json.dumps(d) for d in _docs(600)]
    lines = good[:500] + ['{"text": "unterminated'] + good[500:] + ['{"other": 1}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "o" / "x")
    r = _run(["--input", str(tmp_path / "bad.jsonl"), *GPT2, "--chunk-lines", "64", "--output-prefix", out])
    assert r.returncode == 1
    assert f"{tmp_path / 'bad.jsonl'}:501: invalid JSON" in r.stderr and "--skip-bad-lines" in r.stderr
    assert os.listdir(tmp_path / "o") == []  # nothing half-written, chunks before line 501 included
    # Line 501 lies in the second partition: its line number is still exact.
    r = _run(["--input", str(tmp_path / "bad.jsonl"), *GPT2, "--workers", "2", "--partitions", "2",
              "--output-prefix", out])
    assert r.returncode == 1 and f"{tmp_path / 'bad.jsonl'}:501: invalid JSON" in r.stderr
    assert os.listdir(tmp_path / "o") == []
    r = _run(["--input", str(tmp_path / "bad.jsonl"), *GPT2, "--skip-bad-lines", "--workers", "2",
              "--output-prefix", out])
    assert r.returncode == 0, r.stderr
    assert "skipped 2 malformed line(s)" in r.stderr and ":602: missing key 'text'" in r.stderr
    assert IndexedDataset(out + "_text_document").num_documents == 600


def test_truncated_gzip_is_reported(tmp_path):
    _write(tmp_path / "c.jsonl.gz", _docs(2000), gz=True)
    data = (tmp_path / "c.jsonl.gz").read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(data[: len(data) // 2])
    r = _run(["--input", str(tmp_path / "c.jsonl.gz"), *GPT2, "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 1 and "c.jsonl.gz" in r.stderr and "cannot read input" in r.stderr
    assert not any(f.startswith("o_") for f in os.listdir(tmp_path))


def _sigint_default():
    # The suite may itself run with SIGINT ignored (started by `nohup`, or `make test &` from a
    # script): a real terminal's Ctrl-C reaches a tool whose SIGINT is at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
@pytest.mark.parametrize("workers,sig", [(1, signal.SIGINT), (2, signal.SIGINT), (2, signal.SIGTERM)])
def test_ctrl_c_leaves_no_valid_looking_index(tmp_path, workers, sig):
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    out = str(tmp_path / "o")
    proc = subprocess.Popen([sys.executable, TOOL, "--no-progress", "--input", str(fifo), *GPT2,
                             "--chunk-lines", "4", "--workers", str(workers), "--output-prefix", out],
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    with open(fifo, "w") as w:
        for d in _docs(50):
            w.write(json.dumps(d) + "\n")
        w.flush()
        deadline = time.time() + 30
        while not os.path.exists(out + "_text_document.bin.tmp") and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # let it write a few chunks while the pipe stays open
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.count("Traceback") == 0, err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]


def test_empty_input_warns_or_fails(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    r = _run(["--input", str(tmp_path / "empty.jsonl"), *GPT2, "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 0 and "WARNING: no documents" in r.stderr and "--fail-on-empty" in r.stderr
    from megatron.data.indexed_dataset import IndexedDatasetError
    with pytest.raises(IndexedDatasetError, match="o_text_document: the dataset holds no tokens"):
        IndexedDataset(str(tmp_path / "o_text_document")).require_tokens()
    r = _run(["--input", str(tmp_path / "empty.jsonl"), *GPT2, "--output-prefix", str(tmp_path / "p"),
              "--fail-on-empty"])
    assert r.returncode == 1 and "no documents" in r.stderr
    assert not any(f.startswith("p_") for f in os.listdir(tmp_path))


def test_bad_arguments_exit_2_as_help_says(tmp_path):
    r = _run(["--input", "x", *GPT2, "--output-prefix", str(tmp_path / "o"), "--workers", "abc"])
    assert r.returncode == 2
    assert "2 bad arguments" in _run(["--help"]).stdout


def test_shipped_multitask_set_end_to_end(tmp_path):
    """The shipped (inputs, targets) set -> aligned datasets -> supervised GPT batches."""
    from megatron.data.packing import collate_supervised_gpt, padding_stats
    from megatron.data.samplers import TokenBudgetSampler
    from megatron.data.supervised_dataset import SupervisedDataset
    sp = os.path.join(ROOT, "data", "tokenizers", "kjv_sp4k.model")
    opts = Options(inputs=[os.path.join(ROOT, "data", "multitask", "kjv_tasks.jsonl.gz")],
                   output_prefix=str(tmp_path / "tasks"), json_keys=["inputs", "targets"],
                   tokenizer_kwargs=dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp),
                   append_eod=True, progress=False, workers=2)
    stats = preprocess(opts)
    ds = SupervisedDataset(str(tmp_path / "tasks_inputs_document"), str(tmp_path / "tasks_targets_document"))
    assert len(ds) == stats.documents == 12000 and ds.inputs.dtype == np.uint16
    assert ds.target_lengths.min() >= 2 and ds.target_lengths.max() > 100  # varied lengths
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp)
    rows = [json.loads(line) for _, line in zip(range(3), gzip.open(opts.inputs[0], "rt"))]
    for i, row in enumerate(rows):
        assert tok.detokenize(ds[i]["targets"][:-1]) == row["targets"]
    batch_ids = next(iter(TokenBudgetSampler(ds.input_lengths + ds.target_lengths, 4096, 256)))
    batch = collate_supervised_gpt([ds[i] for i in batch_ids], 256, pad_id=tok.pad)
    assert batch["loss_mask"].sum() == sum(min(int(ds.target_lengths[i]), 256) for i in batch_ids)
    assert 0 < padding_stats(batch["segment_ids"])["efficiency"] <= 1


@pytest.mark.parametrize("line, reason", [
    (b'{"text": "a"}, {"text": "b"}', "invalid JSON (Extra data)"),
    (b'[{"text": "a"}]', "not a JSON array"),
    (b'{"text": 5}', "key 'text' is int, expected a string"),
    (b'"just a string"', "expected a JSON object, got str"),
    (b'{"text": "\xff\xfe"}', "invalid JSON"),
])
def test_chunk_parser_pinpoints_bad_lines(line, reason):
    from megatron.data.preprocess import _parse_chunk
    chunk = [("f.jsonl", 1, b'{"text": "ok"}\n'), ("f.jsonl", 2, line + b"\n"), ("f.jsonl", 3, b"\n"),
             ("f.jsonl", 4, b'{"text": "fine"}\n')]
    docs, bad = _parse_chunk(chunk, ["text"], skip_bad=True)
    assert [d["text"] for d in docs] == ["ok", "fine"]
    assert len(bad) == 1 and bad[0].startswith("f.jsonl:2: ") and reason in bad[0], bad
    docs, bad = _parse_chunk([c for c in chunk if c[1] != 2], ["text"], skip_bad=False)
    assert [d["text"] for d in docs] == ["ok", "fine"] and bad == []


def test_unwritable_output_is_one_line(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the output folder should be: fails even as root
    r = _run(["--input", str(tmp_path / "in.jsonl"), *GPT2, "--output-prefix", str(blocker / "o")])
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "preprocess_data: error:" in r.stderr
