"""T5 wiring for `run_pretraining`: tokenizer (with --vocab-extra-ids sentinels), datasets,
per-stage model, static 1F1B/GPipe planner and the Trainer. Mirrors `build_gpt_trainer`."""
from __future__ import annotations

from megatron.config.core import MegatronConfig
from megatron.training.pretrain import sample_counts, tokenizer_from_config
from megatron.planner.passes import plan_passes


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


def build_t5_trainer(cfg: MegatronConfig, ps, device):
    from megatron.models.t5 import (build_t5_stages, t5_activation_shapes, t5_flops_per_sample,
                                    t5_microbatch, t5_microbatch_shapes, t5_parallel_state, t5_tied_params)
    from megatron.planner.schedule.fixed import FixedBatchPlanner
    from megatron.training.trainer import Trainer
    if cfg.model.model_type != "t5":
        raise ValueError(f"build_t5_trainer needs a T5 config (model_type 't5'), got {cfg.model.model_type!r}")
    tokenizer = tokenizer_from_config(cfg)
    if tokenizer is not None:
        # With a tokenizer, --vocab-size is only its input (NullTokenizer); the model's vocabulary
        # is the tokenizer's, sentinels included. With --mock-data alone it is the whole vocabulary.
        cfg.model.vocab_size = tokenizer.vocab_size
    ps, pos_group = t5_parallel_state(cfg, ps)  # collective: every rank creates the T5 groups
    stages = build_t5_stages(cfg, ps)
    planner = FixedBatchPlanner(cfg.parallel.pipeline_schedule, ps.pp_size, 1,
                                lambda shapes: t5_activation_shapes(cfg, shapes),
                                cfg.training.recompute_level, cfg.training.params_dtype_name,
                                plan_pass=plan_passes(cfg, ps.stage_layouts))
    tied, tied_pos = t5_tied_params(stages)
    flops = t5_flops_per_sample(cfg.model, cfg.model.padded_vocab_size(ps.tp_size))
    # Word embeddings are tied over {0, split, last} (ps.embedding_group); learned position
    # tables only over {0, split}.
    extra = [(tied_pos, pos_group)] if tied_pos and pos_group is not None else []
    if cfg.data.targets_data_path:  # multi-task (inputs, targets): DynaPipe or a baseline
        from megatron.training.pretrain import supervised_source
        source = supervised_source(cfg, ps, tokenizer, planner, t5_microbatch_shapes)
        return Trainer(cfg, ps, device, stages, tied_params=tied, flops_per_sample=flops, batch_source=source,
                       extra_tied_groups=extra, valid_source=source.valid_source)
    train_ds, valid_ds = t5_datasets(cfg, tokenizer)
    return Trainer(cfg, ps, device, stages, train_ds=train_ds, valid_ds=valid_ds, collate_fn=t5_microbatch,
                   planner=planner, tied_params=tied, flops_per_sample=flops, shapes_fn=t5_microbatch_shapes,
                   extra_tied_groups=extra)
