#!/usr/bin/env bash
# DynaPipe: GPT-6.7B (32 layers, hidden 4096, 32 heads) fine-tuned on multi-task (input, target)
# data on one node of 8 A100-40GB, at the layout the simulated grid search found best for
# max length 2048 (experiment_configs/best_configs/a100_sim/gpt_6.7b_L2048_G8.json: PP=2 x TP=1
# x DP=4). Global batches hold 8192 tokens per GPU; the planner cuts each into variable
# micro-batches and picks recompute and schedule per batch from the published A100 cost table.
# Usage: bash examples/dynapipe_gpt_6.7b_8gpu.sh
#   INPUTS=/data/tasks_inputs_document TARGETS=/data/tasks_targets_document (preprocess_data.py
#   --json-keys inputs targets outputs), TOKENIZER=... (the one those were made with), CKPT=...
set -euo pipefail
cd "$(dirname "$0")/.."
INPUTS=${INPUTS:-data/cache/kjv_tasks_sp4k_inputs_document}
TARGETS=${TARGETS:-data/cache/kjv_tasks_sp4k_targets_document}
TOKENIZER=${TOKENIZER:-data/tokenizers/kjv_sp4k.model}
CKPT=${CKPT:-runs/dynapipe-gpt-6.7b/checkpoints}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --tokens-per-global-batch 65536 --train-iters 10000 \
    --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 \
    --data-path "$INPUTS" --targets-data-path "$TARGETS" --split 949,50,1 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --dynapipe --dynapipe-cost-model cost_models/gpt_6.7b_a100.json --dynapipe-memory-limit 36000 \
    --dynapipe-planner-workers 4 --dynapipe-lookahead 8 \
    --save "$CKPT" --load "$CKPT" --save-interval 500 \
    --log-interval 10 --eval-interval 500 --eval-iters 10
