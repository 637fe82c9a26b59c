#!/usr/bin/env bash
# GPT-6.7B (32 layers, hidden 4096, 32 heads) on NNODES nodes x 8 GPUs with torchrun's c10d
# rendezvous: TP=8 inside a node, PP=2 across nodes, DP = NNODES / 2. Start the same command on
# every node (any node may be MASTER_ADDR; the rendezvous assigns ranks):
#   MASTER_ADDR=node001 NNODES=4 bash examples/pretrain_gpt_multinode.sh
# DATA, CKPT, TB as in pretrain_gpt_1node_8gpu.sh; CKPT must be on a file system every node sees.
set -euo pipefail
cd "$(dirname "$0")/.."
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host name of one node}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
JOB_ID=${JOB_ID:-gpt-6.7b}
DATA=${DATA:-data/cache/kjv_gpt2_text_document}
CKPT=${CKPT:-runs/gpt-6.7b/checkpoints}
TB=${TB:-runs/gpt-6.7b/tensorboard}

torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$JOB_ID" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --sequence-parallel \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 512 --train-iters 100000 \
    --lr 1.2e-4 --min-lr 1.2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --recompute-granularity selective --use-distributed-optimizer \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz \
    --save "$CKPT" --load "$CKPT" --save-interval 500 --distributed-timeout-minutes 30 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TB"
