"""A GPT-2 byte-level BPE tokenizer with no merges (every byte one token, plus <|endoftext|>):
GPT-2's vocab.json / merges.txt format, 257 tokens, so that tests can pass a GPT-2 user's
flags (--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file) to this project, to
Megatron-LM and to transformers without downloading GPT-2's 50257-token files."""
import json
import os


def byte_chars() -> dict:
    """GPT-2's table from bytes to printable characters: printable Latin-1 bytes stand for
    themselves, the rest for chr(256 + k) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, k = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + k)
            k += 1
    return out


def write_gpt2_files(folder: str):
    """-> (vocab.json, merges.txt) paths: token id b is byte b, 256 is <|endoftext|>."""
    os.makedirs(folder, exist_ok=True)
    vocab = {c: b for b, c in byte_chars().items()}
    vocab["<|endoftext|>"] = 256
    v, m = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(v, "w") as f:
        json.dump(vocab, f)
    with open(m, "w") as f:
        f.write("#version: 0.2\n")
    return v, m
