"""Tokenizers for --tokenizer-type; see megatron/tokenizer/tokenizers.py."""
from __future__ import annotations

from .tokenizers import (AbstractTokenizer, BertWordPieceTokenizer, GPT2BPETokenizer,
                         GPTSentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer,
                         SentencePieceTokenizer, _require)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HuggingFaceTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                   "NullTokenizer")


def build_tokenizer(tokenizer_type: str, *, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, vocab_extra_ids: int = 0) -> AbstractTokenizer:
    """Build the tokenizer named by --tokenizer-type from local files only.

    Args mirror Megatron's flags: --vocab-file, --merge-file, --tokenizer-model,
    --vocab-size (NullTokenizer) and --vocab-extra-ids (T5 sentinels <extra_id_i>).
    Returns an object with `.vocab_size` (unpadded), `.eod`, `.pad`, `.bos`, `.eos`
    (None where absent), `.tokenize(text)`, `.tokenize_batch(texts)`, `.detokenize(ids)`
    and `.additional_special_tokens_ids`.  Missing inputs raise errors naming the flag.
    """
    t = tokenizer_type
    extra = int(vocab_extra_ids or 0)
    if t == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require(vocab_file, "--vocab-file", t),
                                _require(merge_file, "--merge-file", t), vocab_extra_ids=extra)
    if t == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_require(tokenizer_model, "--tokenizer-model", t), extra)
    if t == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_require(tokenizer_model, "--tokenizer-model", t), extra)
    if t == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_require(tokenizer_model, "--tokenizer-model", t), extra)
    if t in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(_require(vocab_file, "--vocab-file", t),
                                      lower_case=t == "BertWordPieceLowerCase", vocab_extra_ids=extra)
    if t == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size is required for NullTokenizer")
        return NullTokenizer(int(vocab_size), extra)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = ["build_tokenizer", "TOKENIZER_TYPES", "AbstractTokenizer"]
