#!/usr/bin/env bash
# T5 v1.1-large shape (24 + 24 layers, hidden 1024, 16 heads of 64, gated-GeLU FFN 2816, RMSNorm,
# no linear biases, untied LM head: what tools/checkpoint/convert.py --to-hf writes as a
# Flan-T5-style T5ForConditionalGeneration) on one node of 8 GPUs: TP=2 x PP=4 (encoder on
# pipeline ranks 0-1, decoder on 2-3) x DP=1, bf16, span corruption on sentence data.
# Usage: bash examples/pretrain_t5_1node_8gpu.sh
#   DATA=/data/my_corpus_text_sentence (preprocess_data.py --split-sentences output)
#   TOKENIZER=/data/spiece.model (SentencePiece; T5's own works)  CKPT=...  TB=...
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/cache/kjv_sp4k_text_sentence}
TOKENIZER=${TOKENIZER:-data/tokenizers/kjv_sp4k.model}
CKPT=${CKPT:-runs/t5-large/checkpoints}
TB=${TB:-runs/t5-large/tensorboard}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_t5.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --pipeline-model-parallel-split-rank 2 \
    --encoder-num-layers 24 --decoder-num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --kv-channels 64 --ffn-hidden-size 2816 \
    --normalization RMSNorm --disable-bias-linear --gated-linear-unit --untie-embeddings-and-output-weights \
    --position-embedding-type relative --relative-attention-num-buckets 32 --relative-attention-max-distance 128 \
    --encoder-seq-length 512 --decoder-seq-length 128 \
    --micro-batch-size 8 --global-batch-size 256 --train-iters 100000 \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.01 --clip-grad 1.0 --bf16 --recompute-granularity selective \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" --vocab-extra-ids 100 \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TB"
