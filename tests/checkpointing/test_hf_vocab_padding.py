"""A GPT-2 whose recorded vocabulary is Megatron's padded table (50304: transformers'
`convert_megatron_gpt2_checkpoint.py` writes config.json with `padded_vocab_size`, and a
Megatron-LM GPT-2 BPE run records nothing else) trains here with the README's GPT-2 tokenizer
flags (GPT2BPETokenizer, 50257 ids) and no edit to any file: the check compares padded sizes, as
Megatron's own `check_checkpoint_args` compares `padded_vocab_size`. A truly different
vocabulary is still refused, naming the flag."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2 = [os.path.join(ROOT, "data", "gpt2", f) for f in ("gpt2-vocab.json.gz", "gpt2-merges.txt.gz")]
MODEL = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "1000"]


def _hf_gpt2(folder, vocab):
    """A tiny GPT-2 folder with `vocab` rows, as transformers' Megatron -> HF converter leaves it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=8, n_layer=2, n_head=2,
                                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def _dataset(prefix):
    from megatron.data.indexed_dataset import IndexedDatasetBuilder
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    ids = (np.arange(4000) * 7919) % 50257
    for doc in np.array_split(ids, 20):
        b.add_item(doc)
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _pretrain(argv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + MODEL + argv, cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory):
    """Our checkpoint converted (`convert.py --from-hf`) from a GPT-2 that records 50304 rows."""
    from tools.checkpoint import convert
    tmp = tmp_path_factory.mktemp("gpt2_50304")
    hf = _hf_gpt2(str(tmp / "hf"), 50304)
    ours = str(tmp / "ours")
    assert convert.main(["--from-hf", "--load", hf, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    return ours


def test_padded_gpt2_trains_with_the_gpt2_tokenizer(padded_checkpoint, tmp_path):
    data = _dataset(str(tmp_path / "gpt2_text_document"))
    r = _pretrain(["--train-iters", "1", "--load", padded_checkpoint, "--data-path", data, "--split", "949,50,1",
                   "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT2[0], "--merge-file", GPT2[1]], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"loaded checkpoint {padded_checkpoint}" in out and "--vocab-size" not in out


def test_a_truly_different_vocabulary_is_refused_naming_the_flag(padded_checkpoint, tmp_path):
    r = _pretrain(["--train-iters", "1", "--load", padded_checkpoint, "--mock-data", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "1000"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    line = next(x for x in out.splitlines() if "--vocab-size" in x)
    assert "checkpoint has 50304 (padded 50304)" in line and "padded 1024" in line, line


def test_vocab_mismatch_rule():
    from megatron.checkpointing.hints import vocab_mismatch

    def cfg(v, d=128, tp=1):
        return {"model": {"vocab_size": v, "make_vocab_size_divisible_by": d},
                "parallel": {"tensor_model_parallel_size": tp}}
    assert vocab_mismatch(cfg(50304), cfg(50257), "--vocab-size") is None
    assert vocab_mismatch(cfg(50304, tp=2), cfg(50257, tp=2), "--vocab-size") is None  # both 50432
    assert vocab_mismatch(cfg(50257), cfg(50304 + 1), "--vocab-size") is not None
    assert vocab_mismatch(cfg(100), cfg(101, 1), "--vocab-size").startswith("--vocab-size: checkpoint has 100")


def test_megatron_release_of_a_gpt2_trains_with_the_gpt2_tokenizer(tmp_path):
    """HF GPT-2 (50257) -> `--from-hf` -> `--to-megatron` writes what transformers' GPT-2 ->
    Megatron converter writes (`release/`, 50304 rows padded with copies of the last one; the
    two agree tensor for tensor on the converter's own fixture, test_checkpoint_megatron_sources.py).
    `--load` of that folder, and of its `--from-megatron` conversion (no --vocab-size given),
    trains with the README's GPT-2 tokenizer flags."""
    from megatron.checkpointing import megatron_legacy as L
    from tools.checkpoint import convert
    hf = _hf_gpt2(str(tmp_path / "hf"), 50257)
    ours, mega, back = str(tmp_path / "ours"), str(tmp_path / "mega"), str(tmp_path / "back")
    sizes = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]
    assert convert.main(["--from-hf", "--load", hf, "--save", ours] + sizes) == 0
    assert convert.main(["--to-megatron", "--load", ours, "--save", mega] + sizes) == 0
    args, full, meta = L.read_full(mega)
    assert meta["release"] and (args.padded_vocab_size, args.orig_vocab_size) == (50304, 50257)
    w = full["embedding.word_embeddings.weight"]
    assert w.shape[0] == 50304 and torch.equal(w[50257:], w[50256].expand(47, -1))
    assert convert.main(["--from-megatron", "--load", mega, "--save", back] + sizes) == 0
    data = _dataset(str(tmp_path / "gpt2_text_document"))
    for load in (mega, back):
        r = _pretrain(["--train-iters", "1", "--load", load, "--data-path", data, "--split", "949,50,1",
                       "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT2[0], "--merge-file", GPT2[1]],
                      tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        said = f"loaded Megatron-LM checkpoint (legacy model, TP 1 x PP 1) {load}" if load == mega \
            else f"loaded checkpoint {load}"
        assert said in out and " iteration        1/       1 |" in out, out[-2000:]
