#!/usr/bin/env bash
# Optimus-CC convergence on CPU: GPT on the shipped King James text, PP=2 (x DP when NPROC=4),
# the same data, schedule and seed per run, one log per (run, seed):
#   baseline | cb (compressed backpropagation, rank CB_RANK, no residual)
#   | cb_lep (+ lazy error propagation, residual dropped at each iteration end: the default)
#   | cb_lep_carry (LEP as published: the residual crosses the optimizer step)
#   | cb_lep_epilogue (LEP, epilogue-only) | cb_epilogue | cb_lep_dp (+ data-parallel PowerSGD)
#   | dp (PowerSGD with error feedback alone) | dp_rsvd (randomized-SVD reducer) | emb (--emb-grad-comp)
# Every run logs --log-compression-stats. Logs go to $OUT_DIR/<run>_s<seed>.log; then
# experiment_scripts/optimus_cc_report.py writes summary.json, loss_curves.csv (iteration, run,
# seed, loss, bytes per iteration) and, with matplotlib, loss_curves.png.
#
# Environment (all optional): ITERS (150), SEEDS ("1234 42 7"), RUNS ("baseline cb cb_lep cb_lep_carry"),
# NPROC (2: PP=2; 4: PP=2 x DP=2), LAYERS (4), HIDDEN (128), HEADS (4), SEQ (64), MBS (2), GBS (16),
# LR (2e-3), CB_RANK (16), DP_RANK (16), OUT_DIR (experiments/optimus_cc), PYTHON.
# At the defaults one run takes about 1.5 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
ITERS=${ITERS:-150}
SEEDS=${SEEDS:-1234 42 7}
OUT_DIR=${OUT_DIR:-experiments/optimus_cc}
RUNS=${RUNS:-baseline cb cb_lep cb_lep_carry}
NPROC=${NPROC:-2}
LAYERS=${LAYERS:-4}; HIDDEN=${HIDDEN:-128}; HEADS=${HEADS:-4}; SEQ=${SEQ:-64}
MBS=${MBS:-2}; GBS=${GBS:-16}; LR=${LR:-2e-3}
CB_RANK=${CB_RANK:-16}
DP_RANK=${DP_RANK:-16}
[ -f data/cache/kjv_sp4k_text_document.idx ] || bash data/build_sample_data.sh
export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
mkdir -p "$OUT_DIR"

flags_for() {
    local cb="--inter-grad-comp --inter-grad-comp-rank $CB_RANK"
    case "$1" in
        baseline)        echo "" ;;
        cb)              echo "$cb" ;;
        cb_lep)          echo "$cb --use-error-feedback" ;;
        cb_lep_carry)    echo "$cb --use-error-feedback --lep-carry-across-iterations" ;;
        cb_lep_epilogue) echo "$cb --use-error-feedback --inter-grad-comp-epilogue-only" ;;
        cb_epilogue)     echo "$cb --inter-grad-comp-epilogue-only" ;;
        cb_lep_dp)       echo "$cb --use-error-feedback --grad-comp --grad-comp-rank $DP_RANK" ;;
        dp)              echo "--grad-comp --grad-comp-rank $DP_RANK --use-error-feedback" ;;
        dp_rsvd)         echo "--grad-comp --grad-comp-rank $DP_RANK --use-error-feedback --grad-comp-type RandomizedSVD" ;;
        emb)             echo "--emb-grad-comp --emb-grad-comp-rank 16 --emb-use-error-feedback" ;;
        *) echo "run_optimus_cc.sh: unknown run '$1' (choose from baseline cb cb_lep cb_lep_carry cb_lep_epilogue" \
                "cb_epilogue cb_lep_dp dp dp_rsvd emb)" >&2; exit 2 ;;
    esac
}

failed=""
for seed in $SEEDS; do
  for run in $RUNS; do
    extra=$(flags_for "$run")
    log="$OUT_DIR/${run}_s${seed}.log"
    echo "optimus-cc: $run seed $seed ($ITERS iterations) -> $log"
    # shellcheck disable=SC2086
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
        --pipeline-model-parallel-size 2 \
        --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ" \
        --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
        --lr "$LR" --min-lr "$(python3 -c "print($LR / 10)")" --lr-warmup-iters 10 --lr-decay-style cosine \
        --clip-grad 1.0 --weight-decay 0.01 --hidden-dropout 0.0 --attention-dropout 0.0 --seed "$seed" \
        --data-path data/cache/kjv_sp4k_text_document --split 949,50,1 \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/tokenizers/kjv_sp4k.model \
        --log-interval 5 --eval-interval "$ITERS" --eval-iters 4 --log-compression-stats $extra > "$log" 2>&1 \
        || { echo "optimus-cc: run $run seed $seed failed; see $log" >&2; tail -5 "$log" >&2
             failed="$failed ${run}_s${seed}"; }
  done
done
# The report reads whatever the logs hold, so a run that died late still shows its curve.
"$PY" experiment_scripts/optimus_cc_report.py "$OUT_DIR"
if [ -n "$failed" ]; then
    echo "optimus-cc: failed runs:$failed" >&2
    exit 1
fi
