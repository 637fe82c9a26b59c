#!/usr/bin/env bash
# Optimus-CC convergence on CPU: GPT on the shipped King James text, PP=2 x DP=2 (4 processes),
# four runs with the same data, seed and schedule:
#   baseline | cb (compressed backpropagation, rank 16) | cb_lep (+ lazy error propagation)
#   | cb_lep_dp (+ data-parallel PowerSGD, rank 16); also available: cb_lep_epilogue
#   (--inter-grad-comp-epilogue-only) and dp (PowerSGD with error feedback alone)
# Each run's log goes to $OUT_DIR/<run>.log; then experiment_scripts/optimus_cc_report.py
# writes $OUT_DIR/summary.json (final losses, gap to the baseline, bytes per iteration) and,
# with matplotlib, $OUT_DIR/loss_curves.png.
#
# Environment (all optional): ITERS (default 300), OUT_DIR (default experiments/optimus_cc),
# RUNS (default "baseline cb cb_lep cb_lep_dp"), CB_RANK (16), DP_RANK (16), PYTHON.
# Takes ~10 minutes per run on 2 CPU cores at the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
ITERS=${ITERS:-300}
OUT_DIR=${OUT_DIR:-experiments/optimus_cc}
RUNS=${RUNS:-baseline cb cb_lep cb_lep_dp}
CB_RANK=${CB_RANK:-16}
DP_RANK=${DP_RANK:-16}
bash data/build_sample_data.sh
export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
mkdir -p "$OUT_DIR"

flags_for() {
    case "$1" in
        baseline)  echo "" ;;
        cb)        echo "--inter-grad-comp --inter-grad-comp-rank $CB_RANK" ;;
        cb_lep)    echo "--inter-grad-comp --inter-grad-comp-rank $CB_RANK --use-error-feedback" ;;
        cb_lep_dp) echo "--inter-grad-comp --inter-grad-comp-rank $CB_RANK --use-error-feedback --grad-comp --grad-comp-rank $DP_RANK" ;;
        cb_lep_epilogue) echo "--inter-grad-comp --inter-grad-comp-rank $CB_RANK --use-error-feedback --inter-grad-comp-epilogue-only" ;;
        dp)        echo "--grad-comp --grad-comp-rank $DP_RANK --use-error-feedback" ;;
        *) echo "run_optimus_cc.sh: unknown run '$1' (choose from baseline cb cb_lep cb_lep_dp cb_lep_epilogue dp)" >&2; exit 2 ;;
    esac
}

for run in $RUNS; do
    extra=$(flags_for "$run")
    echo "optimus-cc: $run ($ITERS iterations) -> $OUT_DIR/$run.log"
    # shellcheck disable=SC2086
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt.py \
        --pipeline-model-parallel-size 2 \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
        --micro-batch-size 4 --global-batch-size 32 --train-iters "$ITERS" \
        --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.01 \
        --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234 \
        --data-path data/cache/kjv_sp4k_text_document --split 949,50,1 \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/tokenizers/kjv_sp4k.model \
        --log-interval 10 --eval-interval "$ITERS" --eval-iters 4 $extra > "$OUT_DIR/$run.log" 2>&1 \
        || { echo "optimus-cc: run $run failed; see $OUT_DIR/$run.log" >&2; tail -5 "$OUT_DIR/$run.log" >&2
             failed="$failed $run"; }
done
# The report reads whatever the logs hold, so a run that died late still shows its curve.
"$PY" experiment_scripts/optimus_cc_report.py "$OUT_DIR"
if [ -n "${failed:-}" ]; then
    echo "optimus-cc: failed runs:$failed" >&2
    exit 1
fi
