#!/usr/bin/env bash
# A small real training job on CPU: GPT on the shipped King James text (SentencePiece 4k
# tokenizer trained on it), 4 processes as TP=2 x PP=2 (1F1B), about a minute on 2 cores.
# Usage: bash examples/demo_cpu.sh [NPROC]   (run from the repository root; `make demo` does)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${1:-4}
PY=${PYTHON:-.venv/bin/python}
echo "demo: tokenizing the shipped text into data/cache/ (once, ~10 s)"
bash data/build_sample_data.sh
export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# A fresh run directory each time, so a second `make demo` neither overwrites the first run's
# checkpoint nor appends a second TensorBoard stream to its folder (RUN_DIR=... to choose one).
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
if [ -e "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt" ]; then
    echo "demo: $RUN_DIR already holds a checkpoint; resuming from it (--load)"
    set -- "${1:-4}" "${@:2}" --load "$RUN_DIR/checkpoints"
fi
mkdir -p "$RUN_DIR"
echo "demo: run directory $RUN_DIR"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 60 \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.01 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path data/cache/kjv_sp4k_text_document --split 949,50,1 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/tokenizers/kjv_sp4k.model \
    --log-interval 10 --eval-interval 30 --eval-iters 2 \
    --save "$RUN_DIR/checkpoints" --save-interval 60 --tensorboard-dir "$RUN_DIR/tensorboard" "${@:2}" 2>&1 \
    | grep --line-buffered -v -e "^W.*torch/distributed/run.py" -e "OMP_NUM_THREADS" -e "^\*\*\*\*"
