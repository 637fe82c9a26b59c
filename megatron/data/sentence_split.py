"""Sentence splitting for --split-sentences with NLTK Punkt, from parameters shipped in
megatron/tokenizer/punkt_english.json (JSON, not a pickle).  Never downloads: NLTK's
own `sent_tokenize` would fetch `punkt_tab`, which is unavailable offline.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

_PARAM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tokenizer")


@lru_cache(maxsize=None)
def load_punkt(lang: str = "english"):
    """A PunktSentenceTokenizer for `lang` built from the shipped parameters."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    path = os.path.join(_PARAM_DIR, f"punkt_{lang}.json")
    if not os.path.exists(path):
        shipped = sorted(f[6:-5] for f in os.listdir(_PARAM_DIR) if f.startswith("punkt_") and f.endswith(".json"))
        raise ValueError(f"--lang {lang}: no Punkt model shipped ({path} missing); available: {', '.join(shipped)}")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    params = PunktParameters()
    params.abbrev_types = set(raw["abbrev_types"])
    params.collocations = {tuple(c) for c in raw["collocations"]}
    params.sent_starters = set(raw["sent_starters"])
    for word, flags in raw["ortho_context"].items():
        params.ortho_context[word] = flags
    return PunktSentenceTokenizer(params)


def split_sentences(text: str, lang: str = "english", keep_newlines: bool = False) -> list[str]:
    """Split text into sentences.  With keep_newlines the whitespace (and newlines) after
    each sentence stays attached to it, so joining the pieces gives the text back."""
    punkt = load_punkt(lang)
    if not keep_newlines:
        return punkt.tokenize(text)
    spans = list(punkt.span_tokenize(text))
    out = []
    for k, (start, _end) in enumerate(spans):
        stop = spans[k + 1][0] if k + 1 < len(spans) else len(text)
        out.append(text[0 if k == 0 else start:stop])
    return out
