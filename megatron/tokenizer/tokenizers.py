"""Tokenizers selected by --tokenizer-type.  All load local files only: nothing here
ever downloads (HF `tokenizers` reads a tokenizer.json path; SentencePiece a .model).

Common interface (what the trainer and tools/preprocess_data.py use):
    vocab_size            unpadded vocabulary size (the trainer pads it for TP)
    eod, pad, bos, eos    special ids, None where the tokenizer has no such token
    additional_special_tokens_ids   T5 sentinels <extra_id_0..N-1> (--vocab-extra-ids)
    tokenize(text) -> list[int];  tokenize_batch(texts) -> list[list[int]];  detokenize(ids) -> str
"""
from __future__ import annotations

import os
from typing import Optional

from .gpt2_bpe import ByteLevelBPE, load_vocab_and_merges, open_text


def _require(value, flag: str, tokenizer_type: str):
    if value is None:
        raise ValueError(f"{flag} is required for {tokenizer_type}")
    if isinstance(value, str) and not os.path.exists(value):
        raise FileNotFoundError(f"{flag} {value}: file not found (needed by {tokenizer_type})")
    return value


def sentinel_names(n: int) -> list[str]:
    return [f"<extra_id_{i}>" for i in range(n)]


class AbstractTokenizer:
    """Shared defaults; subclasses set the special ids they have."""

    name = "abstract"
    eod: Optional[int] = None
    pad: Optional[int] = None
    bos: Optional[int] = None
    eos: Optional[int] = None
    cls: Optional[int] = None
    sep: Optional[int] = None
    mask: Optional[int] = None
    additional_special_tokens_ids: list[int] = []

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize many texts at once; backends with a batch API override this."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class GPT2BPETokenizer(AbstractTokenizer):
    """GPT-2 BPE from --vocab-file (encoder.json) + --merge-file (vocab.bpe).

    Backends, all giving identical ids (tests compare them on adversarial text):
      "tiktoken"  OpenAI's Rust implementation, fed our local files (fastest);
      "hf"        HF `tokenizers` byte-level BPE built from the same files;
      "python"    the pure-Python reference in gpt2_bpe.py.
    "auto" (default) picks the first that is installed and accepts the vocabulary.
    Sentinels from --vocab-extra-ids get ids after the 50,257 GPT-2 tokens.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, vocab_extra_ids: int = 0,
                 backend: str = "auto"):
        encoder, merges = load_vocab_and_merges(vocab_file, merge_file)
        self.reference = ByteLevelBPE(encoder, merges)
        self.eod = encoder.get("<|endoftext|>")
        if self.eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: no <|endoftext|> token (not a GPT-2 vocab?)")
        self.eos = self.eod  # GPT-2 uses <|endoftext|> as its only boundary token
        self._base = len(encoder)
        self.additional_special_tokens_ids = list(range(self._base, self._base + vocab_extra_ids))
        self._extra = {name: i for name, i in zip(sentinel_names(vocab_extra_ids),
                                                  self.additional_special_tokens_ids)}
        if backend not in ("auto", "tiktoken", "hf", "python"):
            raise ValueError(f"unknown GPT-2 BPE backend {backend!r} (auto, tiktoken, hf, python)")
        self._tiktoken = self._fast = None
        if backend in ("auto", "tiktoken"):
            self._tiktoken = self._make_tiktoken(encoder, strict=backend == "tiktoken")
        if backend == "hf" or (backend == "auto" and self._tiktoken is None):
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
            tok = Tokenizer(models.BPE(vocab=encoder, merges=merges))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            self._fast = tok
        self.backend = "tiktoken" if self._tiktoken else "hf" if self._fast else "python"

    def _make_tiktoken(self, encoder, strict: bool):
        try:
            import tiktoken
        except ImportError:
            if strict:
                raise
            return None
        b2u = {v: k for k, v in self.reference.byte_encoder.items()}
        try:
            ranks = {bytes(b2u[c] for c in tok): i for tok, i in encoder.items() if tok != "<|endoftext|>"}
            # tiktoken's spelling of GPT-2's pattern (same matches, non-capturing group).
            return tiktoken.Encoding(
                "megatron-gpt2-local", explicit_n_vocab=len(encoder),
                pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                mergeable_ranks=ranks, special_tokens={"<|endoftext|>": self.eod})
        except (KeyError, ValueError, AssertionError):
            if strict:
                raise
            return None  # a vocabulary tiktoken cannot represent: fall back to HF

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = None  # thread pools do not pickle (spawned DataLoader workers)
        return state

    def _tiktoken_batch(self, texts: list[str]) -> list[list[int]]:
        """tiktoken releases the GIL while encoding, so a few threads each looping over a
        slice of the batch use every core.  (tiktoken's own encode_batch submits one
        future per text, which costs more than encoding a short document.)"""
        enc = self._tiktoken.encode_ordinary
        # One thread when this process is one of several preprocessing workers.
        threads = 1 if os.environ.get("TOKENIZERS_PARALLELISM") == "false" else min(len(texts), os.cpu_count() or 1)
        if threads <= 1 or len(texts) < 16:
            return [enc(t) for t in texts]
        if getattr(self, "_pool", None) is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpt2-bpe")
        step = -(-len(texts) // threads)
        parts = self._pool.map(lambda lo: [enc(t) for t in texts[lo:lo + step]], range(0, len(texts), step))
        return [ids for part in parts for ids in part]

    @property
    def vocab_size(self) -> int:
        return self._base + len(self._extra)

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self.reference.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return self._tiktoken_batch(texts)
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [self.reference.encode(t) for t in texts]

    def detokenize(self, ids) -> str:
        inv = {v: k for k, v in self._extra.items()}
        out, run = [], []
        for i in ids:
            i = int(i)
            if i in inv:
                out.append(self.reference.decode(run))
                out.append(inv[i])
                run = []
            else:
                run.append(i)
        out.append(self.reference.decode(run))
        return "".join(out)


class SentencePieceTokenizer(AbstractTokenizer):
    """SentencePiece --tokenizer-model with Megatron's added specials.

    Like Megatron's SentencePieceTokenizer, special tokens the model lacks
    (<CLS> <SEP> <EOD> <MASK> <PAD> <BOS> <EOS>, then the T5 sentinels) get new ids
    after the model's pieces; tokens the model defines keep their ids.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        import sentencepiece
        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._n = self.sp.get_piece_size()
        self._added: dict[str, int] = {}
        self._setup_specials(vocab_extra_ids)

    def _id(self, piece: str) -> int:
        pid = self.sp.piece_to_id(piece)
        if pid != self.sp.unk_id() or piece == self.sp.id_to_piece(self.sp.unk_id()):
            return pid
        if piece not in self._added:
            self._added[piece] = self._n + len(self._added)
        return self._added[piece]

    def _setup_specials(self, vocab_extra_ids: int) -> None:
        self.cls, self.sep, self.eod, self.mask = (self._id(p) for p in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        sp_pad, sp_bos, sp_eos = self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()
        self.pad = sp_pad if sp_pad >= 0 else self._id("<PAD>")
        self.bos = sp_bos if sp_bos >= 0 else self._id("<BOS>")
        self.eos = sp_eos if sp_eos >= 0 else self._id("<EOS>")
        self.additional_special_tokens_ids = [self._id(s) for s in sentinel_names(vocab_extra_ids)]
        self._inv_added = {v: k for k, v in self._added.items()}

    @property
    def vocab_size(self) -> int:
        return self._n + len(self._added)

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)  # C++ loop over the batch

    def detokenize(self, ids) -> str:
        out, run = [], []
        for i in ids:
            i = int(i)
            if i in self._inv_added:
                out.append(self.sp.decode(run))
                out.append(self._inv_added[i])
                run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """SentencePiece for GPT (Megatron's GPTSentencePieceTokenizer): no added specials;
    eod is the model's </s> (eos), bos/pad are the model's when it has them."""

    name = "GPTSentencePieceTokenizer"

    def _setup_specials(self, vocab_extra_ids: int) -> None:
        def opt(i):
            return i if i >= 0 else None
        self.eos = opt(self.sp.eos_id())
        self.bos = opt(self.sp.bos_id())
        self.pad = opt(self.sp.pad_id())
        self.eod = self.eos
        if self.eod is None:
            raise ValueError("--tokenizer-model has no </s> (eos) piece, which GPTSentencePieceTokenizer uses as eod")
        self.additional_special_tokens_ids = [self._id(s) for s in sentinel_names(vocab_extra_ids)]
        self._inv_added = {v: k for k, v in self._added.items()}


class _HFBackedTokenizer(AbstractTokenizer):
    """Shared methods of tokenizers backed by an HF `tokenizers` object in `self.tok`."""

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """A local HF `tokenizer.json` (--tokenizer-model PATH, or a directory holding one).

    Specials are looked up by their usual spellings; sentinels are added as special tokens.
    """

    name = "HuggingFaceTokenizer"
    _EOD = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
    _PAD = ("<pad>", "[PAD]", "<|pad|>")
    _BOS = ("<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[CLS]")

    def __init__(self, path: str, vocab_extra_ids: int = 0):
        from tokenizers import AddedToken, Tokenizer
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: no tokenizer.json "
                                    f"(HuggingFaceTokenizer never downloads)")
        self.tok = Tokenizer.from_file(path)
        if vocab_extra_ids:
            self.tok.add_special_tokens([AddedToken(s, special=True) for s in sentinel_names(vocab_extra_ids)])
        self.additional_special_tokens_ids = [self.tok.token_to_id(s) for s in sentinel_names(vocab_extra_ids)]

        def first(names):
            for n in names:
                i = self.tok.token_to_id(n)
                if i is not None:
                    return i
            return None
        self.eod = first(self._EOD)
        self.eos = self.eod
        self.pad = first(self._PAD)
        self.bos = first(self._BOS)


class BertWordPieceTokenizer(_HFBackedTokenizer):
    """BERT WordPiece from --vocab-file vocab.txt (BertWordPieceLowerCase / BertWordPieceCase).

    Uses HF `tokenizers`' BERT normaliser + WordPiece.  As in Megatron, [BOS]/[EOS] and
    the sentinels are appended to the vocabulary when vocab.txt lacks them; eod is [SEP].
    """

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0):
        from tokenizers import AddedToken
        from tokenizers.implementations import BertWordPieceTokenizer as _HFBert
        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        self.tok = _HFBert(vocab_file, lowercase=lower_case, strip_accents=lower_case)
        vocab = self.tok.get_vocab()
        for name in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if name not in vocab:
                raise ValueError(f"--vocab-file {vocab_file}: missing {name}, not a BERT vocab.txt")
        extra = [n for n in ["[BOS]", "[EOS]"] + sentinel_names(vocab_extra_ids) if n not in vocab]
        if extra:
            self.tok.add_special_tokens([AddedToken(n, special=True) for n in extra])
        t2i = self.tok.token_to_id
        self.cls, self.sep, self.pad, self.mask = t2i("[CLS]"), t2i("[SEP]"), t2i("[PAD]"), t2i("[MASK]")
        self.bos, self.eos = t2i("[BOS]"), t2i("[EOS]")
        self.eod = self.sep
        self.additional_special_tokens_ids = [t2i(s) for s in sentinel_names(vocab_extra_ids)]
        self._continuation = None

    def continuation_mask(self):
        """Bool per id: True for "##" word-continuation pieces (T5 whole-word masking)."""
        if self._continuation is None:
            import numpy as np
            mask = np.zeros(self.vocab_size, dtype=bool)
            for token, i in self.tok.get_vocab(with_added_tokens=True).items():
                mask[i] = token.startswith("##")
            self._continuation = mask
        return self._continuation


class NullTokenizer(AbstractTokenizer):
    """Text is whitespace-separated integer ids (Megatron's NullTokenizer).

    --vocab-size N gives ids 0..N-1; eod is the extra id N, so vocab_size is N + 1.
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int, vocab_extra_ids: int = 0):
        self._n = int(vocab_size)
        self.eod = self._n
        self.eos = self.eod
        self.additional_special_tokens_ids = list(range(self._n + 1, self._n + 1 + vocab_extra_ids))

    @property
    def vocab_size(self) -> int:
        return self._n + 1 + len(self.additional_special_tokens_ids)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer expects whitespace-separated integers, got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} outside [0, {self.vocab_size}) (--vocab-size {self._n})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def read_text(path: str) -> str:
    with open_text(path) as f:
        return f.read()
