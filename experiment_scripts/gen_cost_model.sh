#!/usr/bin/env bash
# Profile per-layer cost models for the DynaPipe planner (megatron.profiling.profile_model).
#
# Runs two invocations with Megatron-style model flags:
#   GPT: hidden 64, 4 heads, FFN 256, vocab 4096 (data/tokenizers/kjv_sp4k), TP 1,
#        micro-batch sizes 1..16 x sequence lengths 16..512, recompute none/selective/full
#        -> $OUT_DIR/${PREFIX}_tiny_gpt.json
#   T5:  same layer shape, micro-batch sizes 1..8 x encoder lengths 16..128 x decoder lengths 16..64
#        -> $OUT_DIR/${PREFIX}_tiny_t5.json
# On a CPU this takes a few minutes (QUICK=1: a coarse grid, well under a minute); on a GPU
# set the model flags to the real model (the grids are env vars below).
#
# Environment (all optional):
#   OUT_DIR    where the JSON files go            (default: runs/cost_models-<date-time>; the shipped,
#              tracked cost_models/*.json are only overwritten with OVERWRITE=1 OUT_DIR=cost_models)
#   PREFIX     file name prefix                   (default: cpu, or gpu when DEVICE=cuda)
#   DEVICE     cpu | cuda                         (default: cuda if torch sees one)
#   TP         tensor-parallel sizes, e.g. 1,2    (default: 1)
#   MODELS     which invocations: "gpt t5"        (default: both)
#   GPT_MBS / GPT_SEQS, T5_MBS / T5_ENC_SEQS / T5_DEC_SEQS   grid overrides
#   STATISTIC  median | min per shape             (default: min on CPU, median on CUDA)
#   WARMUP / ITERS / LAYERS                       (default: 1 / 5 (QUICK: 3) / 2)
#   QUICK=1    coarse grid for a smoke test
#   CALIBRATE  1: fit the GPT table's host calibration (default on CPU without QUICK; megatron.profiling.calibrate)
#   PYTHON     interpreter                        (default: .venv/bin/python if present)
# Extra arguments are passed to every invocation, e.g. --max-seconds-per-shape 5.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
DEVICE=${DEVICE:-$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
OUT_DIR=${OUT_DIR:-runs/cost_models-$(date +%Y%m%d-%H%M%S)}
PREFIX=${PREFIX:-$( [ "$DEVICE" = cuda ] && echo gpu || echo cpu )}
TP=${TP:-1}
MODELS=${MODELS:-"gpt t5"}
if [ "${QUICK:-0}" = 1 ]; then
  GPT_MBS=${GPT_MBS:-1,4}; GPT_SEQS=${GPT_SEQS:-16,64}
  T5_MBS=${T5_MBS:-1,4}; T5_ENC_SEQS=${T5_ENC_SEQS:-16,64}; T5_DEC_SEQS=${T5_DEC_SEQS:-16,32}
  ITERS=${ITERS:-3}
fi
WARMUP=${WARMUP:-1}; ITERS=${ITERS:-5}; LAYERS=${LAYERS:-2}
GPT_MBS=${GPT_MBS:-1,2,4,8,16}; GPT_SEQS=${GPT_SEQS:-16,32,64,128,256,512}
T5_MBS=${T5_MBS:-1,2,4,8}; T5_ENC_SEQS=${T5_ENC_SEQS:-16,32,64,128}; T5_DEC_SEQS=${T5_DEC_SEQS:-16,32,64}
mkdir -p "$OUT_DIR"
for m in $MODELS; do
  f="$OUT_DIR/${PREFIX}_tiny_${m}.json"
  if [ -e "$f" ] && [ "${OVERWRITE:-0}" != 1 ]; then
    echo "gen_cost_model.sh: $f exists; set OVERWRITE=1 to replace it, or choose another OUT_DIR" >&2
    exit 2
  fi
done
echo "gen_cost_model.sh: writing to $OUT_DIR" >&2

MODEL_ARGS=(--hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --vocab-size 4096
            --hidden-dropout 0.1 --attention-dropout 0.1)
# min over iterations on a CPU: other processes sharing the cores only ever add time.
STATISTIC=${STATISTIC:-$( [ "$DEVICE" = cuda ] && echo median || echo min )}
COMMON=(--tp "$TP" --recompute none,selective,full --num-layers-profiled "$LAYERS"
        --warmup "$WARMUP" --iters "$ITERS" --statistic "$STATISTIC" --device "$DEVICE")

for m in $MODELS; do
  case $m in
    gpt) "$PYTHON" -m megatron.profiling.profile_model --model-type gpt "${MODEL_ARGS[@]}" "${COMMON[@]}" \
           --micro-batch-sizes "$GPT_MBS" --seq-lengths "$GPT_SEQS" \
           --output "$OUT_DIR/${PREFIX}_tiny_gpt.json" "$@" ;;
    t5)  "$PYTHON" -m megatron.profiling.profile_model --model-type t5 "${MODEL_ARGS[@]}" "${COMMON[@]}" \
           --micro-batch-sizes "$T5_MBS" --seq-lengths "$T5_ENC_SEQS" --decoder-seq-lengths "$T5_DEC_SEQS" \
           --output "$OUT_DIR/${PREFIX}_tiny_t5.json" "$@" ;;
    *) echo "gen_cost_model.sh: MODELS may list gpt and t5, got '$m'" >&2; exit 2 ;;
  esac
done

# On a CPU the ranks of a job share the host's cores: fit what the layer table leaves out of a
# training step here (megatron/planner/cost/calibration.py) from short plain GPT runs, into the table.
if [ "${CALIBRATE:-$( [ "$DEVICE" = cpu ] && [ "${QUICK:-0}" != 1 ] && echo 1 || echo 0 )}" = 1 ] && [[ " $MODELS " == *" gpt "* ]]; then
  "$PYTHON" -m megatron.profiling.calibrate --dynapipe-cost-model "$OUT_DIR/${PREFIX}_tiny_gpt.json" \
    -- --num-layers 4 "${MODEL_ARGS[@]}" --max-position-embeddings 512
fi
