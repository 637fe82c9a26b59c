import os

import pytest

from megatron.tokenizer import build_tokenizer

from .conftest import DATA

TOK = os.path.join(DATA, "tokenizers")
TEXT = "And God said, Let there be light: and there was light."


def test_sentencepiece_megatron_specials():
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=os.path.join(TOK, "kjv_sp4k.model"),
                          vocab_extra_ids=5)
    ids = tok.tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT and all(0 <= i < 4096 for i in ids)
    # The model defines bos/eos/pad itself; <CLS> <SEP> <EOD> <MASK> and sentinels are appended.
    assert (tok.bos, tok.eos, tok.pad) == (1, 2, 3)
    added = [tok.cls, tok.sep, tok.eod, tok.mask] + tok.additional_special_tokens_ids
    assert added == list(range(4096, 4096 + 9)) and tok.vocab_size == 4105
    assert tok.detokenize(ids[:2] + [tok.additional_special_tokens_ids[0]]).endswith("<extra_id_0>")
    assert tok.tokenize_batch([TEXT, "light"]) == [ids, tok.tokenize("light")]


def test_gpt_sentencepiece():
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=os.path.join(TOK, "kjv_sp4k.model"))
    assert tok.vocab_size == 4096 and tok.eod == tok.eos == 2 and tok.bos == 1 and tok.pad == 3
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_huggingface_tokenizer_json():
    tok = build_tokenizer("HuggingFaceTokenizer",
                          tokenizer_model=os.path.join(TOK, "kjv_bytelevel_tokenizer.json"), vocab_extra_ids=2)
    assert tok.eod == 0 and tok.pad == 1 and tok.vocab_size == 4098
    assert tok.additional_special_tokens_ids == [4096, 4097]
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(TOK))  # a folder without tokenizer.json


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_wordpiece(kind):
    tok = build_tokenizer(kind, vocab_file=os.path.join(TOK, "kjv_wordpiece-vocab.txt"), vocab_extra_ids=3)
    ids = tok.tokenize(TEXT)
    text = tok.detokenize(ids)
    assert text.replace(" ", "").lower() == TEXT.replace(" ", "").lower()
    if kind == "BertWordPieceCase":
        assert "God" in text
    assert tok.eod == tok.sep and tok.pad is not None and tok.bos is not None and tok.eos is not None
    assert len(set(tok.additional_special_tokens_ids)) == 3 and max(tok.additional_special_tokens_ids) < tok.vocab_size


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100, vocab_extra_ids=2)
    assert tok.tokenize("1 2 99") == [1, 2, 99] and tok.detokenize([3, 4]) == "3 4"
    assert tok.eod == 100 and tok.additional_special_tokens_ids == [101, 102] and tok.vocab_size == 103
    with pytest.raises(ValueError, match="--vocab-size is required"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="whitespace-separated integers"):
        tok.tokenize("hello")


def test_missing_model_flag():
    with pytest.raises(ValueError, match="--tokenizer-model is required for SentencePieceTokenizer"):
        build_tokenizer("SentencePieceTokenizer")
