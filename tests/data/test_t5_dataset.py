import numpy as np
import pytest

from megatron.data.t5_dataset import build_t5_datasets, geometric_spans
from megatron.tokenizer import build_tokenizer

from .util import make_dataset


class _Tok:
    bos, eos, pad = 1, 2, 0
    additional_special_tokens_ids = list(range(1000, 1100))


def _sentence_docs(n_docs=60, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(10, 900, rng.integers(3, 25)).tolist() for _ in range(rng.integers(2, 12))]
            for _ in range(n_docs)]


def test_span_statistics():
    rng = np.random.RandomState(0)
    lengths, fractions = [], []
    for _ in range(400):
        spans = geometric_spans(512, 0.15, rng)
        masked = sum(e - s for s, e in spans)
        fractions.append(masked / 512)
        lengths.extend(e - s for s, e in spans)
        for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
            assert e1 < s2  # disjoint and never adjacent
    assert abs(np.mean(fractions) - 0.15) < 0.005
    # Geometric(p=0.2) truncated at 10 has mean ~3.9; long spans get cut by neighbours/budget.
    assert 3.0 < np.mean(lengths) < 4.5 and max(lengths) <= 10
    assert abs(np.mean(np.array(lengths) == 1) - 0.2) < 0.05


def test_t5_samples(tmp_path):
    docs = _sentence_docs()
    prefix = make_dataset(str(tmp_path / "s"), docs)
    train, valid, test = build_t5_datasets([prefix], "90,10,0", 64, 32, _Tok(), 1234, (200, 10, 0),
                                           str(tmp_path / "cache"))
    assert test is None and len(train) == 200 and len(valid) == 10
    for i in range(len(train)):
        item = train[i]
        assert set(item) >= {"text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"}
        enc, dec, lab, lm = item["text_enc"], item["text_dec"], item["labels"], item["loss_mask"]
        assert enc.shape == (64,) and dec.shape == (32,) and lab.shape == (32,)
        n_dec = int(lm.sum())
        assert dec[0] == 1 and lab[n_dec - 1] == 2 and (lab[n_dec:] == -1).all()
        np.testing.assert_array_equal(dec[1:n_dec], lab[:n_dec - 1])  # teacher forcing shift
        # Undo the corruption: put the spans back at their sentinels and compare with the source.
        sent_enc = [t for t in enc if t >= 1000]
        sent_lab = [t for t in lab if t >= 1000]
        assert sent_enc == sent_lab == list(range(1000, 1000 + len(sent_enc))) and sent_enc
        spans, cur = {}, None
        for t in lab[:n_dec - 1]:
            if t >= 1000:
                cur = t
                spans[cur] = []
            else:
                spans[cur].append(int(t))
        restored = []
        for t in enc[:int(item["enc_mask"][0].sum())]:
            restored.extend(spans[t] if t >= 1000 else [int(t)])
        first, end, _ = train.samples_mapping[i] if hasattr(train, "samples_mapping") else (0, 0, 0)
        source = np.concatenate([train.indexed[s] for s in range(first, end)])
        np.testing.assert_array_equal(restored, source[:len(restored)])
        assert item["dec_mask"][0, 1] == False and item["dec_mask"][1, 0] == True  # noqa: E712
    # Deterministic per index.
    np.testing.assert_array_equal(train[3]["text_enc"], train[3]["text_enc"])


def test_t5_needs_sentinels(tmp_path):
    prefix = make_dataset(str(tmp_path / "s"), _sentence_docs(5))
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        build_t5_datasets([prefix], "1", 32, 16, tok, 1, (10,))


def test_whole_word_spans():
    rng = np.random.RandomState(1)
    word_starts = np.random.RandomState(2).rand(300) < 0.6  # ~40% of tokens continue a word
    word_starts[0] = True
    total = 0
    for _ in range(200):
        spans = geometric_spans(300, 0.15, rng, word_starts=word_starts)
        for s, e in spans:
            assert word_starts[s] and (e == 300 or word_starts[e])  # whole words only
        total += sum(e - s for s, e in spans)
    assert abs(total / (200 * 300) - 0.15) < 0.02


def test_wordpiece_tokenizer_drives_whole_word_masking(tmp_path):
    import os
    vocab = os.path.join(os.path.dirname(__file__), "..", "..", "data", "tokenizers", "kjv_wordpiece-vocab.txt")
    tok = build_tokenizer("BertWordPieceCase", vocab_file=vocab, vocab_extra_ids=10)
    cont = tok.continuation_mask()
    ids = tok.tokenize("Jehoshaphat and Zerubbabel went unto Mahershalalhashbaz")
    assert cont[ids].any() and not cont[ids[0]]
    prefix = make_dataset(str(tmp_path / "w"), [[ids, ids], [ids]])
    tok.bos = tok.bos if tok.bos is not None else tok.cls
    train, _, _ = build_t5_datasets([prefix], "1", 64, 32, tok, 3, (20,), None)
    for i in range(len(train)):
        enc = train[i]["text_enc"]
        sentinel_pos = np.flatnonzero(np.isin(enc, tok.additional_special_tokens_ids))
        for p in sentinel_pos:  # the token after a masked span never continues a word
            if p + 1 < len(enc) and enc[p + 1] != tok.pad:
                assert not cont[enc[p + 1]]
