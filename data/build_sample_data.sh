#!/usr/bin/env bash
# Builds the preprocessed demo datasets from the shipped compressed text into data/cache/
# (git-ignored).  Idempotent: skips outputs that already exist unless FORCE=1.
#   bash data/build_sample_data.sh            # uses .venv/bin/python if present
# Outputs (prefixes for --data-path):
#   data/cache/kjv_gpt2_text_document          GPT-2 BPE, one chapter per document, eod appended
#   data/cache/kjv_sp4k_text_document          SentencePiece 4k (small vocab for CPU demos), eod appended
#   data/cache/kjv_sp4k_text_sentence          same, one sequence per sentence (T5 span corruption)
#   data/cache/kjv_tasks_sp4k_{inputs,targets}_document   aligned supervised pairs (--targets-data-path)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=data/cache
mkdir -p "$OUT"
GPT2=(--tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2/gpt2-vocab.json.gz --merge-file data/gpt2/gpt2-merges.txt.gz)
SP=(--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/tokenizers/kjv_sp4k.model)
WORKERS=${WORKERS:-1}

run() {  # run <expected .idx> <args...>
  local idx=$1; shift
  if [ -z "${FORCE:-}" ] && [ -f "$idx" ]; then echo "exists: $idx"; return; fi
  "$PY" tools/preprocess_data.py --workers "$WORKERS" --no-progress "$@"
}
run "$OUT/kjv_gpt2_text_document.idx" --input data/kjv/kjv.jsonl.gz "${GPT2[@]}" --append-eod --output-prefix "$OUT/kjv_gpt2"
run "$OUT/kjv_sp4k_text_document.idx" --input data/kjv/kjv.jsonl.gz "${SP[@]}" --append-eod --output-prefix "$OUT/kjv_sp4k"
run "$OUT/kjv_sp4k_text_sentence.idx" --input data/kjv/kjv.jsonl.gz "${SP[@]}" --split-sentences --output-prefix "$OUT/kjv_sp4k"
run "$OUT/kjv_tasks_sp4k_targets_document.idx" --input data/multitask/kjv_tasks.jsonl.gz "${SP[@]}" \
    --json-keys inputs targets --append-eod --output-prefix "$OUT/kjv_tasks_sp4k"
echo "sample data ready under $OUT"
