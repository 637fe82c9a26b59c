"""Pretrain T5 (encoder-decoder). Launch with torchrun, e.g. on CPU:

    torchrun --standalone --nproc_per_node 4 pretrain_t5.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1 \
        --encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --kv-channels 16 --encoder-seq-length 64 --decoder-seq-length 32 --micro-batch-size 2 \
        --global-batch-size 8 --train-iters 20 --mock-data --vocab-size 512 --vocab-extra-ids 10

Pipeline ranks [0, split) run the encoder and [split, PP) the decoder. Real data: sentence-level
.bin/.idx from `tools/preprocess_data.py --split-sentences`, a --tokenizer-type and
--vocab-extra-ids (the span-corruption sentinels).
"""
from __future__ import annotations

import sys

from megatron.cli.arguments import exit_with_error, parse_args
from megatron.config.core import ConfigError
from megatron.training.pretrain import run_pretraining
from megatron.cli.startup_checks import check_inputs_or_exit
from megatron.training.t5_builder import build_t5_trainer

if __name__ == "__main__":
    cfg = parse_args(sys.argv[1:], model_type="t5")
    try:
        from megatron.models.t5 import t5_stage_layers
        t5_stage_layers(cfg)  # split-rank / layer-count errors before any process group exists
    except ConfigError as e:
        exit_with_error("t5", e)
    check_inputs_or_exit(cfg)  # data and tokenizer files, before any process group or model
    sys.exit(run_pretraining(cfg, build_trainer=build_t5_trainer))
