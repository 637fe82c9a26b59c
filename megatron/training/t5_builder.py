"""T5 for `run_pretraining`: its `ModelSpec` (stages with the encoder/decoder groups, tied
embeddings and position tables, span-corruption datasets) for the one builder in `pretrain.py`."""
from __future__ import annotations

from megatron.config.core import MegatronConfig
from megatron.models.t5 import t5_flops_per_sample, t5_microbatch, t5_microbatch_shapes
from megatron.training.pretrain import ModelSpec, build_trainer, sample_counts


def t5_datasets(cfg: MegatronConfig, tokenizer):
    t, m = cfg.training, cfg.model
    n_train, n_valid = sample_counts(cfg)
    if cfg.data.mock_data:
        from megatron.data.mock_dataset import MockT5Dataset
        args = (m.encoder_seq_length, m.decoder_seq_length, m.vocab_size)
        extra = cfg.data.vocab_extra_ids
        return (MockT5Dataset(n_train, *args, seed=t.seed, num_sentinels=extra),
                MockT5Dataset(n_valid, *args, seed=t.seed + 1, num_sentinels=extra))
    if tokenizer is None:
        raise ValueError("T5 pretraining on --data-path needs --tokenizer-type (with --vocab-extra-ids for the "
                         "sentinels), or use --mock-data")
    from megatron.data.t5_dataset import build_t5_datasets
    train, valid, _ = build_t5_datasets(cfg.data.data_path, cfg.data.split, m.encoder_seq_length,
                                        m.decoder_seq_length, tokenizer, t.seed, (n_train, n_valid, 0),
                                        cfg.data.data_cache_path)
    return train, valid


def _t5_build(cfg: MegatronConfig, ps):
    from megatron.models.t5 import build_t5_stages, t5_parallel_state, t5_tied_params
    ps, pos_group = t5_parallel_state(cfg, ps)  # collective: every rank creates the T5 groups
    stages = build_t5_stages(cfg, ps)
    tied, tied_pos = t5_tied_params(stages)
    # Word embeddings are tied over {0, split, last} (ps.embedding_group); learned position
    # tables only over {0, split}.
    extra = [(tied_pos, pos_group)] if tied_pos and pos_group is not None else []
    return ps, stages, 1, tied, extra


def _t5_activation_shapes(cfg: MegatronConfig, ps, shapes):
    from megatron.models.t5 import t5_activation_shapes
    return t5_activation_shapes(cfg, shapes)


T5 = ModelSpec("t5", _t5_build, _t5_activation_shapes, t5_microbatch_shapes, t5_microbatch, t5_flops_per_sample,
               t5_datasets)


def build_t5_trainer(cfg: MegatronConfig, ps, device):
    return build_trainer(cfg, ps, device, T5)
