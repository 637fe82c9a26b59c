"""Files for the other readers, as a careless colleague or a broken download leaves them: a Hugging
Face config whose head count does not divide, a truncated safetensors file, a binary merges or
vocabulary file. Each is one line naming the file."""
import json
import os

import pytest

from megatron.tokenizer.gpt2_bpe import load_vocab_and_merges

VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "data", "gpt2", "gpt2-vocab.json.gz")


def test_binary_merges_file_is_named(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_bytes(b"\xce\x80\xff\xfe" * 100)
    with pytest.raises(ValueError) as e:
        load_vocab_and_merges(VOCAB, str(merges))
    assert f"--merge-file {merges}: unreadable" in str(e.value) and "\n" not in str(e.value)


def test_binary_vocab_file_is_named(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(b"\xce\x80\xff\xfe" * 100)
    with pytest.raises(ValueError, match=f"--vocab-file {vocab}: not UTF-8"):
        load_vocab_and_merges(str(vocab), str(vocab))


def _hf_folder(path, **edit):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, n_positions=16, vocab_size=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(c, **edit)))
    return path


def _convert_error(src, tmp_path, capsys):
    from tools.checkpoint import convert
    capsys.readouterr()  # (what building the test folder printed)
    rc = convert.main(["--load", str(src), "--save", str(tmp_path / "out"), "--from-hf",
                       "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("convert: error:"), err
    return err


def test_hf_heads_not_dividing_is_one_line(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf", n_head=3)
    err = _convert_error(src, tmp_path, capsys)
    assert str(src / "config.json") in err and "n_embd 16 is not divisible by n_head 3" in err, err


def test_truncated_safetensors_is_one_line(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = _convert_error(src, tmp_path, capsys)
    assert str(src / "model.safetensors") in err and "not a readable safetensors file" in err, err
