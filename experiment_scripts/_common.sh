# Shared by the experiment drivers (sourced). Parses --simulate | --live, --force, --config FILE;
# anything else is passed to `python -m megatron.experiments`.
# Default back-end: --live when a CUDA device is visible, else --simulate.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MODE=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --simulate) MODE=--simulate ;;
    --live) MODE=--live ;;
    -h|--help) sed -n "2,/^source/p" "$SELF" | sed -e 's/^# \{0,1\}//' -e "/^source/d"; exit 0 ;;
    *) EXTRA+=("$1") ;;
  esac
  shift
done
if [ -z "$MODE" ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    MODE=--live
  else
    MODE=--simulate
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exp() { "$PY" -m megatron.experiments "$@"; }
need_sample_data() {  # the live back-end trains on the tokenized multi-task set
  [ -f data/cache/kjv_tasks_sp4k_inputs_document.idx ] || bash data/build_sample_data.sh
}
