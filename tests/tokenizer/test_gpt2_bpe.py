"""GPT-2 BPE ids must equal the reference on varied and adversarial text."""
import gzip
import json
import random

import pytest

from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.tokenizers import GPT2BPETokenizer
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode

TEXTS = [
    "Hello world",
    "In the beginning God created the heaven and the earth.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n  mixed \u00a0nbsp\u3000ideographic space",
    "contractions: I'm you're they've we'll he'd it's don't CAN'T",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "unicode: naïve café Ünïcödé ß 東京 Москва مرحبا 🤖🚀 👩‍👩‍👧 e\u0301",
    "symbols !!!??? ... --- @@@ ### $$$ %%% ^^^ &&& *** ((( ))) <|endoftext|>",
    "a" * 3000,
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 20,
    " " * 50 + "x" + " " * 50,
    "",
    "\x00\x01\x7f control chars \ufeff BOM",
    "code: def f(x):\n    return x**2  # comment\n",
]


def _random_texts(n=40, seed=0):
    rng = random.Random(seed)
    alphabet = "abc XYZ 019 .,;'\"\n\t  éü東🙂-_'s're"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(n)]


def test_known_ids(gpt2_tokenizer):
    assert gpt2_tokenizer.tokenize("Hello world") == [15496, 995]
    assert gpt2_tokenizer.vocab_size == 50257 and gpt2_tokenizer.eod == 50256


@pytest.mark.parametrize("backend", ["hf", "tiktoken"])
def test_fast_backends_equal_python_reference(gpt2_files, backend):
    if backend == "tiktoken":
        pytest.importorskip("tiktoken")
    tok = GPT2BPETokenizer(*gpt2_files, backend=backend)
    assert tok.backend == backend
    texts = TEXTS + _random_texts()
    for t, ids in zip(texts, tok.tokenize_batch(texts)):
        assert tok.reference.encode(t) == ids == tok.tokenize(t), t[:60]
        assert tok.detokenize(ids) == t


def test_against_tiktoken(gpt2_files):
    """tiktoken is OpenAI's own implementation; used when installed (offline, local files)."""
    tiktoken = pytest.importorskip("tiktoken")
    enc_json = json.load(gzip.open(gpt2_files[0], "rt"))
    b2u = {v: k for k, v in bytes_to_unicode().items()}
    ranks = {bytes(b2u[c] for c in tok): i for tok, i in enc_json.items() if tok != "<|endoftext|>"}
    enc = tiktoken.Encoding(
        "gpt2-local", explicit_n_vocab=50257,
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    for t in TEXTS + _random_texts(seed=1):
        assert tok.reference.encode(t) == enc.encode_ordinary(t), t[:60]


def test_sentinels_and_errors(gpt2_files):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1],
                          vocab_extra_ids=3)
    assert tok.vocab_size == 50260 and tok.additional_special_tokens_ids == [50257, 50258, 50259]
    assert tok.detokenize([15496, 50258, 995]) == "Hello<extra_id_1> world"
    with pytest.raises(ValueError, match="--vocab-file is required for GPT2BPETokenizer"):
        build_tokenizer("GPT2BPETokenizer", merge_file=gpt2_files[1])
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file="/nonexistent")
    with pytest.raises(ValueError, match="--tokenizer-type 'Nope'"):
        build_tokenizer("Nope")


def test_pickles_after_batch_use(gpt2_tokenizer):
    import pickle
    gpt2_tokenizer.tokenize_batch(["a b c"] * 64)
    clone = pickle.loads(pickle.dumps(gpt2_tokenizer))
    assert clone.tokenize_batch(["Hello world"] * 20)[0] == [15496, 995]
