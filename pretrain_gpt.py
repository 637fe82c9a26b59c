"""Pretrain GPT. Launch with torchrun, e.g. on CPU:

    torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 50 --mock-data --vocab-size 1024
"""
from __future__ import annotations

import sys

from megatron.cli.arguments import parse_args
from megatron.training.pretrain import run_pretraining
from megatron.cli.startup_checks import check_inputs_or_exit

if __name__ == "__main__":
    cfg = parse_args(sys.argv[1:], model_type="gpt")
    check_inputs_or_exit(cfg)  # data and tokenizer files, before any process group or model
    sys.exit(run_pretraining(cfg))
