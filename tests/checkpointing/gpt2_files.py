"""GPT-2's own tokenizer files (data/gpt2, shipped gzipped) unpacked where Megatron-LM and
transformers expect plain files, so that tests pass a GPT-2 user's flags
(--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt)."""
import gzip
import os
import shutil

GPT2 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data", "gpt2")
VOCAB = 50257  # GPT-2's tokens; Megatron pads them to 50304 (a multiple of 128)


def write_gpt2_files(folder: str):
    """-> (vocab.json, merges.txt) paths under `folder`."""
    os.makedirs(folder, exist_ok=True)
    out = []
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            with gzip.open(os.path.join(GPT2, name + ".gz"), "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        out.append(path)
    return tuple(out)
