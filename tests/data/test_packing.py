import numpy as np
import torch
import torch.nn.functional as F

from megatron.data.packing import (collate_supervised_gpt, collate_supervised_t5, pack_samples,
                                   packed_attention_mask, padding_stats)


class TinyCausalAttention(torch.nn.Module):
    """Embedding + learned positions + one attention layer, for the no-leak check."""

    def __init__(self, vocab=50, d=16, heads=2, max_pos=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(max_pos, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, tokens, position_ids, mask):
        x = self.emb(tokens) + self.pos(position_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


def test_next_fit_layout():
    samples = [np.arange(1, 6), np.arange(10, 14), np.arange(20, 23), np.arange(30, 40), np.array([], int)]
    out = pack_samples(samples, 10)
    assert out["tokens"].shape == (3, 10)
    # row 0: 5 + 4 tokens (the 3-token sample does not fit in 1 free slot -> new row)
    assert out["segment_ids"][0].tolist() == [1] * 5 + [2] * 4 + [0]
    assert out["segment_ids"][1].tolist() == [1] * 3 + [0] * 7
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert out["labels"][0, :4].tolist() == [2, 3, 4, 5] and out["loss_mask"][0, 4] == 0
    assert out["labels"][0, 5:8].tolist() == [11, 12, 13] and out["loss_mask"][0, 8] == 0
    assert out["loss_mask"].sum() == 4 + 3 + 2 + 9
    st = padding_stats(out["segment_ids"])
    assert st["real_tokens"] == 22 and st["computed_tokens"] == 30


def test_packed_samples_do_not_attend_to_each_other():
    torch.manual_seed(0)
    model = TinyCausalAttention()
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 50, n) for n in (7, 5, 9, 3, 12, 4)]
    packed = pack_samples(samples, 16)
    seg = torch.as_tensor(packed["segment_ids"])
    mask = packed_attention_mask(seg)
    assert mask.shape == (len(seg), 1, 16, 16) and mask.dtype == torch.bool
    y = model(torch.as_tensor(packed["tokens"]), torch.as_tensor(packed["position_ids"]), mask)
    assert torch.isfinite(y).all()  # padding rows are not empty -> no NaN
    k = 0
    for r in range(len(seg)):
        for s_id in range(1, int(seg[r].max()) + 1):
            cols = (seg[r] == s_id).nonzero().flatten()
            alone_tok = torch.as_tensor(samples[k]).unsqueeze(0)
            alone = model(alone_tok, torch.arange(len(samples[k])).unsqueeze(0),
                          torch.ones(len(samples[k]), len(samples[k]), dtype=torch.bool).tril())
            torch.testing.assert_close(y[r, cols], alone[0], rtol=1e-5, atol=1e-6)
            k += 1
    assert k == len(samples)
    # Without the block-diagonal mask the second sample of a row would see the first.
    plain = torch.ones(16, 16, dtype=torch.bool).tril()
    y_leak = model(torch.as_tensor(packed["tokens"]), torch.as_tensor(packed["position_ids"]), plain)
    assert not torch.allclose(y_leak[0, 7:12], y[0, 7:12])


def test_collate_supervised_gpt_loss_only_on_targets():
    pairs = [{"inputs": np.array([1, 2, 3]), "targets": np.array([7, 8])},
             {"inputs": np.arange(100, 120), "targets": np.array([9, 9, 9])}]
    out = collate_supervised_gpt(pairs, 8)
    assert out["tokens"][0, :4].tolist() == [1, 2, 3, 7] and out["labels"][0, :4].tolist() == [2, 3, 7, 8]
    assert out["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    # Too long: inputs are cut from the left, the whole target stays.
    assert out["labels"][1, -3:].tolist() == [9, 9, 9] and out["loss_mask"][1].sum() == 3
    assert out["tokens"][1, 0] == 114
    assert padding_stats(out["segment_ids"])["real_tokens"] == 4 + 8


def test_collate_supervised_t5():
    out = collate_supervised_t5([{"inputs": np.array([5, 6]), "targets": np.array([7])}], 4, 4, bos=1, eos=2, pad=0)
    assert out["text_enc"][0].tolist() == [5, 6, 0, 0]
    assert out["text_dec"][0].tolist() == [1, 7, 0, 0] and out["labels"][0].tolist() == [7, 2, -1, -1]
    assert out["enc_mask"][0, :, 2].sum() == 0 and out["dec_mask"][0, 0, 1] == False  # noqa: E712


def test_t5_packed_rows_keep_pairs_apart():
    from megatron.data.packing import next_fit_rows, pack_t5_rows
    pairs = [{"inputs": [5, 6, 7], "targets": [8]}, {"inputs": [9], "targets": [10, 11]},
             {"inputs": [12, 13, 14, 15], "targets": [16, 17, 18]}]
    sizes = [(len(p["inputs"]), len(p["targets"]) + 1) for p in pairs]
    rows = next_fit_rows(sizes, (5, 6))
    assert rows == [[0, 1], [2]]
    d = pack_t5_rows(pairs, rows, 5, 6, bos=1, eos=2, pad=0)
    assert d["text_enc"][0].tolist() == [5, 6, 7, 9, 0]
    assert d["text_dec"][0].tolist() == [1, 8, 1, 10, 11, 0]
    assert d["labels"][0].tolist() == [8, 2, 10, 11, 2, -1]
    assert d["enc_position_ids"][0].tolist() == [0, 1, 2, 0, 0]
    assert d["dec_position_ids"][0].tolist() == [0, 1, 0, 1, 2, 0]
    # pair 1's decoder tokens see only pair 1's inputs and earlier pair-1 decoder tokens
    assert d["enc_dec_mask"][0, 3].tolist() == [False, False, False, True, False]
    assert d["dec_mask"][0, 4].tolist() == [False, False, True, True, True, False]
    assert d["enc_mask"][0, 0].tolist() == [True, True, True, False, False]
    assert not d["enc_mask"][0, 4].any() and d["loss_mask"][0].tolist() == [1, 1, 1, 1, 1, 0]
