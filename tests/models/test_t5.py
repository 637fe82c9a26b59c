"""T5 model unit tests (single process): bucketing, stage layout and shapes, masks, no decoder
look-ahead, padding invariance, mock data, collate, FLOPs."""
import dataclasses

import pytest
import torch

from megatron.config.core import ConfigError
from megatron.core.parallel_state import ParallelState
from megatron.data.mock_dataset import MockT5Dataset
from megatron.models.t5 import (RelativePositionBias, build_t5_stages, relative_position_bucket,
                                t5_activation_shapes, t5_flops_per_sample, t5_microbatch, t5_microbatch_shapes,
                                t5_stage_layers)
from tests.training.test_t5_parity import VOCAB, tiny_t5_config


def _bucket(rel, bidirectional, n=32, d=128):
    return relative_position_bucket(torch.tensor(rel), bidirectional, n, d).tolist()


def test_bidirectional_buckets_match_t5_formula():
    # 16 buckets per direction: 8 exact, then log-spaced up to 128; keys after the query get +16.
    rel = [0, -1, -7, -8, -16, -127, -128, -1000, 1, 7, 16, 200]
    assert _bucket(rel, True) == [0, 1, 7, 8, 10, 15, 15, 15, 17, 23, 26, 31]


def test_causal_buckets_ignore_the_future_and_saturate():
    rel = [3, 0, -1, -15, -16, -32, -127, -1000]
    assert _bucket(rel, False) == [0, 0, 1, 15, 16, 21, 31, 31]
    dist = torch.arange(0, 300)
    b = relative_position_bucket(-dist, False, 32, 128)
    assert bool((b[1:] >= b[:-1]).all()), "buckets must not decrease with distance"


def test_relative_bias_looks_up_its_table():
    cfg = tiny_t5_config().model
    rb = RelativePositionBias(cfg, None, bidirectional=True, seed=1, key="k")
    bias = rb(5, 7)
    assert bias.shape == (1, cfg.num_attention_heads, 5, 7)
    rel = torch.arange(7)[None, :] - torch.arange(5)[:, None]
    want = rb.weight[relative_position_bucket(rel, True, cfg.relative_attention_num_buckets,
                                              cfg.relative_attention_max_distance)]
    torch.testing.assert_close(bias[0], want.permute(2, 0, 1))


def test_stage_layout_and_split_rank_errors():
    assert t5_stage_layers(tiny_t5_config(pp=4, split=2)) == [((0, 1), (0, 0)), ((1, 2), (0, 0)),
                                                              ((0, 0), (0, 1)), ((0, 0), (1, 2))]
    assert t5_stage_layers(tiny_t5_config()) == [((0, 2), (0, 2))]
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-split-rank"):
        t5_stage_layers(tiny_t5_config(pp=2))
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-split-rank must be in \(0, 2\)"):
        t5_stage_layers(tiny_t5_config(pp=2, split=2))
    with pytest.raises(ConfigError, match="--encoder-num-layers"):
        t5_stage_layers(tiny_t5_config(pp=4, split=3, enc_layers=2))
    with pytest.raises(ConfigError, match="--decoder-num-layers"):
        t5_stage_layers(tiny_t5_config(pp=4, split=1, enc_layers=2, dec_layers=2))
    cfg = tiny_t5_config(pos="learned_absolute", dec_seq=32)
    cfg.model.max_position_embeddings = 16
    with pytest.raises(ConfigError, match="--max-position-embeddings"):
        t5_stage_layers(cfg)
    cfg = tiny_t5_config(pp=2, split=1)
    cfg.parallel.num_layers_per_virtual_pipeline_stage = 1
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage is not supported for T5"):
        t5_stage_layers(cfg)


def _batch(cfg, n=2, start=0):
    m = cfg.model
    ds = MockT5Dataset(64, m.encoder_seq_length, m.decoder_seq_length, m.vocab_size, num_sentinels=5)
    return t5_microbatch([ds[i] for i in range(start, start + n)])


def _single_stage(cfg):
    torch.manual_seed(0)
    (stage,) = build_t5_stages(cfg, ParallelState()).values()
    return stage.eval()


def test_pipeline_stages_chain_to_the_single_stage_losses():
    """Encoder stage -> ((s_enc, b, h),); decoder stage gets it and returns the same losses as PP=1."""
    cfg1, cfg2 = tiny_t5_config(), tiny_t5_config(pp=2, split=1, world=2)
    batch = _batch(cfg1)
    ref = _single_stage(cfg1)(batch, [])[0]
    enc = build_t5_stages(cfg2, ParallelState(pp_size=2, pp_rank=0))[0].eval()
    dec = build_t5_stages(cfg2, ParallelState(pp_size=2, pp_rank=1))[1].eval()
    (h,) = enc(batch, [])
    (b, s_enc), (_, s_dec) = t5_microbatch_shapes(batch)
    shapes = t5_activation_shapes(cfg2, [t5_microbatch_shapes(batch)])
    assert shapes(0, 0) == ((s_enc, b, 32),) and tuple(h.shape) == shapes(0, 0)[0]
    assert shapes(0, 1) == ((s_dec, b, 32), (s_enc, b, 32))
    losses = dec(batch, [h])[0]
    assert losses.shape == (b, s_dec)
    torch.testing.assert_close(losses, ref)
    # A middle decoder stage (PP=3, split 1) outputs the decoder states and passes the encoder output on.
    cfg3 = tiny_t5_config(pp=3, split=1, world=3)
    mid = build_t5_stages(cfg3, ParallelState(pp_size=3, pp_rank=1))[1].eval()
    y, e = mid(batch, [h])
    assert y.shape == (s_dec, b, 32) and e is h and mid.deallocatable_outputs == (0,)


@pytest.mark.parametrize("pos", ["relative", "learned_absolute"])
def test_decoder_does_not_look_ahead(pos):
    cfg = tiny_t5_config(pos=pos)
    stage = _single_stage(cfg)
    batch = _batch(cfg)
    base = stage(batch, [])[0]
    k = 3
    for full_mask in (False, True):  # the model stays causal even if the data's dec_mask is not
        b = dict(batch)
        if full_mask:
            b["dec_mask"] = torch.ones_like(batch["dec_mask"])
        b["text_dec"] = batch["text_dec"].clone()
        b["text_dec"][:, k:] = (b["text_dec"][:, k:] + 7) % VOCAB
        out = stage(b, [])[0]
        torch.testing.assert_close(out[:, :k], stage(dict(b, text_dec=batch["text_dec"]), [])[0][:, :k])
        torch.testing.assert_close(out[:, :k], base[:, :k])
        assert not torch.allclose(out[:, k:], base[:, k:]), "later decoder positions must see the change"


def test_fully_masked_rows_attend_everywhere_instead_of_nan():
    from megatron.models.t5 import _attention_mask
    m = torch.tensor([[[True, False, False], [False, False, False], [True, True, False]]])
    out = _attention_mask(m)
    assert out.shape == (1, 1, 3, 3)
    assert out[0, 0].tolist() == [[True, False, False], [True, True, True], [True, True, False]]


def test_padding_is_masked_and_encoder_is_attended():
    cfg = tiny_t5_config()
    stage = _single_stage(cfg)
    batch = _batch(cfg)
    base = stage(batch, [])[0]
    assert torch.isfinite(base).all()
    valid_enc = batch["enc_mask"].diagonal(dim1=-2, dim2=-1)
    valid_dec = batch["loss_mask"].bool()
    assert (~valid_enc).any() and (~valid_dec).any(), "mock samples must contain padding"
    noisy = dict(batch, text_enc=batch["text_enc"].masked_fill(~valid_enc, 17),
                 text_dec=batch["text_dec"].masked_fill(~valid_dec, 23))
    out = stage(noisy, [])[0]
    torch.testing.assert_close(out[valid_dec], base[valid_dec])  # padding changes nothing real
    changed = dict(batch, text_enc=(batch["text_enc"] + 1) % VOCAB)
    assert not torch.allclose(stage(changed, [])[0][valid_dec], base[valid_dec]), "cross-attention is dead"


def test_mock_t5_dataset_is_deterministic_and_consistent():
    a, b = MockT5Dataset(10, 16, 8, VOCAB, seed=3, num_sentinels=5), MockT5Dataset(10, 16, 8, VOCAB, seed=3,
                                                                                   num_sentinels=5)
    for i in range(10):
        s, t = a[i], b[i]
        assert all((s[k] == t[k]).all() for k in s)
        n_dec = int(s["loss_mask"].sum())
        assert s["labels"][n_dec - 1] == MockT5Dataset.EOS and s["text_dec"][0] == MockT5Dataset.BOS
        assert (s["text_dec"][1:n_dec] == s["labels"][:n_dec - 1]).all()
        assert s["labels"][0] == s["text_enc"][0]  # the target starts from the encoder input
        content = s["text_enc"][s["enc_mask"].diagonal()]
        assert content.min() >= 3 and content.max() < VOCAB - 5  # sentinel ids are never generated
    assert not (a[0]["text_enc"] == MockT5Dataset(10, 16, 8, VOCAB, seed=4)[0]["text_enc"]).all()
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        MockT5Dataset(1, 16, 8, 8, num_sentinels=4)


def test_collate_types_and_shapes():
    cfg = tiny_t5_config()
    mb = _batch(cfg, n=3)
    assert t5_microbatch_shapes(mb) == ((3, 16), (3, 8))
    assert mb["loss_mask"].dtype == torch.float32 and mb["enc_mask"].dtype == torch.bool
    assert mb["labels"].dtype == torch.int64 and mb["enc_dec_mask"].shape == (3, 8, 16)
    with pytest.raises(KeyError, match="text_dec"):
        t5_microbatch([{"text_enc": [1]}])


def test_flops_of_one_decoder_layer():
    m = tiny_t5_config().model
    m2 = dataclasses.replace(m, decoder_num_layers=3)
    h, p, f, se, sd = m.hidden_size, m.projection_size, m.ffn_hidden_size, 16, 8
    gpt_layer = sd * 3 * (6 * h * p + 4 * sd * p + 2 * p * h + 4 * h * f)
    cross = 3 * (sd * (2 * h * p + 4 * se * p + 2 * p * h) + se * 4 * h * p)
    assert t5_flops_per_sample(m2, 104) - t5_flops_per_sample(m, 104) == pytest.approx(gpt_layer + cross)
