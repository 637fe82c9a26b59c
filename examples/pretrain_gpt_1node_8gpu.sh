#!/usr/bin/env bash
# GPT-1.3B (24 layers, hidden 2048, 16 heads, sequence 2048) on one node of 8 GPUs:
# TP=2 x PP=2 x DP=2, bf16, selective recompute, distributed optimizer, GPT-2 BPE.
# Usage: bash examples/pretrain_gpt_1node_8gpu.sh   (from any folder; override the paths below)
#   DATA=/data/my_corpus_text_document   (a tools/preprocess_data.py output prefix)
#   CKPT=/checkpoints/gpt-1.3b  TB=/tensorboard/gpt-1.3b
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/cache/kjv_gpt2_text_document}   # the shipped sample (bash data/build_sample_data.sh)
CKPT=${CKPT:-runs/gpt-1.3b/checkpoints}
TB=${TB:-runs/gpt-1.3b/tensorboard}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 256 --train-iters 100000 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --recompute-granularity selective --use-distributed-optimizer \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TB"
