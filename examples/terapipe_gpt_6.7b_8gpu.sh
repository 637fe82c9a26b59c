#!/usr/bin/env bash
# TeraPipe: GPT-6.7B (32 layers, hidden 4096, 32 heads) with sequence 2048 pipelined over 8 GPUs
# (PP=8, 4 layers a stage) along the token dimension: each micro-batch runs as token slices
# whose lengths TeraPipe's dynamic program picks from the latency model t(b, l, c) derived from
# the A100 table (cost_models/terapipe_gpt_6.7b_a100.json; profile your own device with
# `python -m megatron.planner.terapipe.latency --output FILE --hidden-size 4096 --num-attention-heads 32 ...`).
# Usage: bash examples/terapipe_gpt_6.7b_8gpu.sh   (DATA=..., CKPT=..., LATENCY_MODEL=...)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/cache/kjv_gpt2_text_document}
LATENCY_MODEL=${LATENCY_MODEL:-cost_models/terapipe_gpt_6.7b_a100.json}
CKPT=${CKPT:-runs/terapipe-gpt-6.7b/checkpoints}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8 \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --global-batch-size 32 --train-iters 50000 \
    --lr 1.2e-4 --min-lr 1.2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 \
    --terapipe --terapipe-slices auto --terapipe-cost-model "$LATENCY_MODEL" --terapipe-memory-limit 30000 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10
