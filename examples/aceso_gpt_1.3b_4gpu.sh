#!/usr/bin/env bash
# Aceso: GPT-1.3B (24 layers, hidden 2048, 16 heads, sequence 2048) on 4 V100s with the
# heterogeneous 3-stage configuration Aceso's search found (examples/aceso/gpt_1.3b_4gpu_3stages.json:
# stage 0 TP=2 with 9 layers, stages 1 and 2 one GPU each, per-layer recompute, micro-batch 1,
# global batch 16). The file sets the layout, micro and global batch; the flags give the model.
# Re-search for your cluster:
#   python -m megatron.aceso search --db megatron/aceso/data/miniset --model gpt-1.3b --gpus 4 \
#       --memory-gb 12 --global-batch 16 --runnable --out-dir runs/aceso
# Usage: bash examples/aceso_gpt_1.3b_4gpu.sh   (ACESO_CONFIG=runs/aceso/best.json for your own)
set -euo pipefail
cd "$(dirname "$0")/.."
ACESO_CONFIG=${ACESO_CONFIG:-examples/aceso/gpt_1.3b_4gpu_3stages.json}
DATA=${DATA:-data/cache/kjv_gpt2_text_document}
CKPT=${CKPT:-runs/aceso-gpt-1.3b/checkpoints}

torchrun --standalone --nproc_per_node 4 pretrain_gpt.py \
    --aceso-config "$ACESO_CONFIG" \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 --train-iters 50000 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 \
    --fp16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10
