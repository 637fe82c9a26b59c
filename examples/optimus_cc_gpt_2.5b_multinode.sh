#!/usr/bin/env bash
# Optimus-CC: GPT-2.5B (32 layers, hidden 2560, 32 heads) on NNODES nodes x 8 GPUs (default 4:
# TP=4 inside a node, PP=4, DP=2) whose inter-node links are the bottleneck, with all three
# compressions: low-rank compressed activation gradients between pipeline stages with lazy error
# propagation (--inter-grad-comp --use-error-feedback), PowerSGD on the data-parallel gradients
# of the selected stages (--grad-comp --selective-grad-comp), and the fused embedding sync
# (--emb-comm-opt). Start the same command on every node:
#   MASTER_ADDR=node001 NNODES=4 bash examples/optimus_cc_gpt_2.5b_multinode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host name of one node}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA=${DATA:-data/cache/kjv_gpt2_text_document}
CKPT=${CKPT:-runs/optimus-cc-gpt-2.5b/checkpoints}

torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id optimus-cc-gpt-2.5b \
    pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 \
    --num-layers 32 --hidden-size 2560 --num-attention-heads 32 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 512 --train-iters 100000 \
    --lr 1.6e-4 --min-lr 1.6e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 --recompute-granularity selective \
    --inter-grad-comp --inter-grad-comp-rank 128 --use-error-feedback \
    --grad-comp --grad-comp-rank 128 --grad-comp-warm-up 0.1 --selective-grad-comp --selective-grad-comp-way 2 --emb-comm-opt \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 --distributed-timeout-minutes 30 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10
