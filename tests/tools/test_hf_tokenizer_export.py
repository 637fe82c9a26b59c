"""`convert.py --to-hf` writes the run's tokenizer: transformers' AutoTokenizer loads the folder
and gives the ids our tokenizer gave the training data (the shipped corpus and hostile text),
and AutoModelForCausalLM loads the same folder."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "data" / "tokenizers"
GPT2 = {"vocab_file": str(ROOT / "data" / "gpt2" / "gpt2-vocab.json.gz"),
        "merge_file": str(ROOT / "data" / "gpt2" / "gpt2-merges.txt.gz")}
CASES = {
    "GPT2BPETokenizer": GPT2,
    "GPTSentencePieceTokenizer": {"tokenizer_model": str(TOK / "kjv_sp4k.model")},
    "SentencePieceTokenizer": {"tokenizer_model": str(TOK / "kjv_sp4k.model"), "vocab_extra_ids": 8},
    "HuggingFaceTokenizer": {"tokenizer_model": str(TOK / "kjv_bytelevel_tokenizer.json")},
    "BertWordPieceLowerCase": {"vocab_file": str(TOK / "kjv_wordpiece-vocab.txt")},
}
HOSTILE = ["  leading spaces\nand newlines\n\n  x\t", "Ünïcödé 123 ,.;  ", "ﬁ ① ＡＢ", "😀 ∑ \u200b", "", " ",
           "the LORD said unto Moses"]


def _texts(n=150):
    out = list(HOSTILE)
    with gzip.open(ROOT / "data" / "kjv" / "kjv.jsonl.gz", "rt") as f:
        for line in f:
            out.append(json.loads(line)["text"][:2000])
            if len(out) >= n:
                break
    return out


@pytest.mark.parametrize("kind", sorted(CASES))
def test_autotokenizer_gives_the_training_ids(kind, tmp_path):
    sys.path.insert(0, str(ROOT))
    from tools.checkpoint.hf_tokenizer import write_tokenizer
    d = dict(CASES[kind], tokenizer_type=kind)
    write_tokenizer(str(tmp_path), d, 128)
    ours = build_tokenizer(kind, **{k: v for k, v in d.items() if k != "tokenizer_type"})
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.model_max_length == 128
    for text in _texts():
        ids = ours.tokenize(text)
        if kind.startswith("Bert"):  # Megatron's WordPiece ids carry no [CLS]/[SEP]; HF's call adds them
            assert hf(text, add_special_tokens=False)["input_ids"] == ids, text[:60]
        else:
            assert hf(text)["input_ids"] == ids, text[:60]
    for name, i in zip([f"<extra_id_{k}>" for k in range(d.get("vocab_extra_ids", 0))],
                       ours.additional_special_tokens_ids):
        assert hf.convert_tokens_to_ids(name) == i


def test_to_hf_folder_loads_with_auto_classes_after_a_real_run(tmp_path):
    """A one-iteration pretrain_gpt.py run on the shipped data, converted as the docs say."""
    data = ROOT / "data" / "cache" / "kjv_sp4k_text_document"
    if not Path(str(data) + ".bin").exists():
        pytest.skip("bash data/build_sample_data.sh builds the sample data")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MEGATRON_NO_FUSED_KERNELS="1")
    ckpt, hf_dir = tmp_path / "ckpt", tmp_path / "hf"
    r = subprocess.run([sys.executable, "pretrain_gpt.py", "--num-layers", "1", "--hidden-size", "32",
                        "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "1",
                        "--global-batch-size", "1", "--train-iters", "1", "--data-path", str(data), "--split",
                        "100,0,0", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                        "data/tokenizers/kjv_sp4k.model", "--save", str(ckpt)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--load", str(ckpt), "--save", str(hf_dir),
                        "--to-hf"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "tokenizer.model, tokenizer.json" in r.stdout, r.stdout + r.stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    ids = tok("In the beginning God created the heaven", return_tensors="pt")["input_ids"]
    assert ids.tolist()[0] == build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(
        TOK / "kjv_sp4k.model")).tokenize("In the beginning God created the heaven")
    assert model(ids).logits.shape[-1] >= tok.vocab_size
