#!/usr/bin/env bash
# Everything in order: grid search, benchmark, ablation, then Figs 13-18. Resumable: jobs whose
# result row exists are skipped (--force redoes them; failed live runs are always retried).
#   run_all.sh [--simulate | --live] [--force] [--no-live-smoke]
# --simulate (default without a GPU): the A100 grid (experiment_configs/a100_sim.json) in
#   simulation, plus the live CPU smoke grid (experiment_configs/cpu_live_smoke.json: tiny GPT/T5,
#   PP=2 over 2 gloo ranks, a few iterations) whose measured iterations are Fig 18's data.
#   --no-live-smoke leaves that out (Fig 18 then shows only rows already in experiments/).
# --live: the grid search and benchmark run live (default grid: the CPU smoke grid; pass
#   --config for your own), the ablation is simulated.
source "$(dirname "$0")/_common.sh"
SMOKE=1
ARGS=()
for a in "${EXTRA[@]+"${EXTRA[@]}"}"; do
  if [ "$a" = --no-live-smoke ]; then SMOKE=0; else ARGS+=("$a"); fi
done
T0=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }
if [ "$MODE" = --simulate ]; then
  step "grid search (simulate)";        exp grid-search --simulate "${ARGS[@]+"${ARGS[@]}"}"
  step "benchmark (simulate)";          exp benchmark --simulate "${ARGS[@]+"${ARGS[@]}"}"
  step "ablation (simulate)";           exp ablation --simulate "${ARGS[@]+"${ARGS[@]}"}"
  step "DynaPipe x TeraPipe figure (simulate)"
  "$PY" -m megatron.experiments.slicing --out reproduced_figures
  if [ "$SMOKE" = 1 ]; then
    need_sample_data
    step "live CPU smoke for Fig 18";   exp grid-search --live "${ARGS[@]+"${ARGS[@]}"}"
    exp benchmark --live "${ARGS[@]+"${ARGS[@]}"}"
  fi
else
  need_sample_data
  step "grid search (live)";            exp grid-search --live "${ARGS[@]+"${ARGS[@]}"}"
  step "benchmark (live)";              exp benchmark --live "${ARGS[@]+"${ARGS[@]}"}"
  step "ablation (simulate)";           exp ablation --simulate "${ARGS[@]+"${ARGS[@]}"}"
fi
step "figures"
rc=0
exp figures "$MODE" "${ARGS[@]+"${ARGS[@]}"}" || rc=$?
step "done"
exit $rc
