"""Tokenizer files someone else wrote: a vocabulary that is not token -> distinct small id is
one error line naming the flag and file (a forged huge id must not size a table)."""
import json

import pytest

from megatron.tokenizer.gpt2_bpe import load_vocab_and_merges


@pytest.mark.parametrize("vocab,needle", [
    ([1, 2, 3], "expected a JSON object"),
    ({"a": "0", "b": 1}, "expected a JSON object"),
    ({"a": 0, "b": 10 ** 12}, "distinct id"),
    ({"a": 0, "b": 0}, "distinct id"),
    ({"a": -1}, "distinct id"),
])
def test_hostile_gpt2_vocab(tmp_path, vocab, needle):
    v, m = tmp_path / "vocab.json", tmp_path / "merges.txt"
    v.write_text(json.dumps(vocab))
    m.write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match=needle) as e:
        load_vocab_and_merges(str(v), str(m))
    assert f"--vocab-file {v}" in str(e.value) and "\n" not in str(e.value)


def test_vocab_nested_too_deeply(tmp_path):
    v, m = tmp_path / "vocab.json", tmp_path / "merges.txt"
    v.write_text("[" * 200000)
    m.write_text("")
    with pytest.raises(ValueError, match="--vocab-file"):
        load_vocab_and_merges(str(v), str(m))
