import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "data")


@pytest.fixture(scope="session")
def gpt2_files():
    return (os.path.join(DATA, "gpt2", "gpt2-vocab.json.gz"), os.path.join(DATA, "gpt2", "gpt2-merges.txt.gz"))


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files):
    from megatron.tokenizer import build_tokenizer
    return build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
