"""The tokenizer files of a --to-hf folder, so `AutoTokenizer.from_pretrained(folder)` gives the
ids the run trained on (tests compare them with our tokenizer on the shipped corpus).

- GPT2BPETokenizer: vocab.json + merges.txt (uncompressed), GPT2Tokenizer in tokenizer_config.json;
- SentencePieceTokenizer / GPTSentencePieceTokenizer: tokenizer.model (the file itself) and a
  tokenizer.json built from it. transformers' own conversion of a SentencePiece model (as Llama's)
  leaves out the model's normalizer (NFKC, stripped and collapsed whitespace), so text with
  newlines or repeated spaces would get other ids: the normalizer is rebuilt from the model's spec;
- HuggingFaceTokenizer: its tokenizer.json;
- BertWordPiece*: vocab.txt, BertTokenizer.
T5 sentinels (--vocab-extra-ids) and the specials our tokenizers append keep their ids.
"""
from __future__ import annotations

import json
import os
import shutil

from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.gpt2_bpe import open_text


def tokenizer_files(data: dict, overrides: dict) -> dict:
    """The run's tokenizer settings (checkpoint config "data"), with the convert flags given."""
    d = {k: data.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids")}
    d.update({k: v for k, v in overrides.items() if v is not None})
    return d


def write_tokenizer(out: str, d: dict, max_length: int) -> str:
    """Write the files into `out`; returns a line saying what was written (or why nothing was).
    Raises OSError / ValueError when the tokenizer cannot be built from its files."""
    t = d.get("tokenizer_type")
    if t in (None, "NullTokenizer"):
        return f"no tokenizer files: the run used {t or '--vocab-size with no tokenizer'} (ids only)"
    extra = int(d.get("vocab_extra_ids") or 0)
    ours = build_tokenizer(t, vocab_file=d.get("vocab_file"), merge_file=d.get("merge_file"),
                           tokenizer_model=d.get("tokenizer_model"), vocab_extra_ids=extra)
    cfg = {"model_max_length": max_length}
    if t == "GPT2BPETokenizer":
        for src, name in ((d["vocab_file"], "vocab.json"), (d["merge_file"], "merges.txt")):
            with open_text(src) as f, open(os.path.join(out, name), "w", encoding="utf-8") as g:
                shutil.copyfileobj(f, g)
        cfg.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False,
                   **{k: "<|endoftext|>" for k in ("bos_token", "eos_token", "unk_token")})
        if extra:
            cfg["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(extra)]
        written = "vocab.json, merges.txt"
    elif t in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        shutil.copyfile(d["vocab_file"], os.path.join(out, "vocab.txt"))
        cfg.update(tokenizer_class="BertTokenizer", do_lower_case=t == "BertWordPieceLowerCase")
        written = "vocab.txt"
    else:
        if t == "HuggingFaceTokenizer":
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(d["tokenizer_model"])
            written = "tokenizer.json"
        else:
            shutil.copyfile(d["tokenizer_model"], os.path.join(out, "tokenizer.model"))
            tok = _sentencepiece_tokenizer(d["tokenizer_model"])
            written = "tokenizer.model, tokenizer.json"
        _add_appended_specials(tok, ours)
        tok.save(os.path.join(out, "tokenizer.json"))
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        for name, i in (("bos_token", ours.bos), ("eos_token", ours.eos), ("pad_token", ours.pad),
                        ("unk_token", getattr(getattr(ours, "sp", None), "unk_id", lambda: None)())):
            if i is not None and tok.id_to_token(i) is not None:
                cfg[name] = tok.id_to_token(i)
        if extra:
            cfg["additional_special_tokens"] = [tok.id_to_token(i) for i in ours.additional_special_tokens_ids]
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return f"wrote the tokenizer ({t}): {written}, tokenizer_config.json"


def _sentencepiece_tokenizer(model_path: str):
    """A `tokenizers.Tokenizer` with SentencePiece's ids: transformers' Llama conversion of the
    model (pieces, merges, byte fallback, decoder), with the normalizer the model specifies."""
    import tempfile
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, normalizers
    from transformers import LlamaTokenizer
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    with tempfile.TemporaryDirectory() as tmp:  # the converter reads a folder's tokenizer.model
        shutil.copyfile(model_path, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"add_bos_token": False, "add_eos_token": False, "legacy": True}, f)
        tok = LlamaTokenizer.from_pretrained(tmp).backend_tokenizer
    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None  # the normalizer above already marks word starts
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="$A", pair="$A $B")  # ids as tokenize() gives: no bos/eos
    return tok


def _add_appended_specials(tok, ours) -> None:
    """Tokens our tokenizer numbers after the model's vocabulary (SentencePiece's missing
    <CLS>/<SEP>/<EOD>/<MASK>, T5 sentinels): added in id order so each keeps its id."""
    from tokenizers import AddedToken
    added = dict(getattr(ours, "_added", {}))
    for i in ours.additional_special_tokens_ids:
        added.setdefault(f"<extra_id_{ours.additional_special_tokens_ids.index(i)}>", i)
    for name, i in sorted(added.items(), key=lambda kv: kv[1]):
        if tok.token_to_id(name) == i:
            continue
        if tok.get_vocab_size(with_added_tokens=True) != i:
            raise ValueError(f"tokenizer: {name} has id {i} in the run, but the exported vocabulary has "
                             f"{tok.get_vocab_size(with_added_tokens=True)} entries before it")
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
