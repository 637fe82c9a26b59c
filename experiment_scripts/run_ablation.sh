#!/usr/bin/env bash
# Ablation at DynaPipe's best layout -> experiments/ablation.jsonl: partition algorithm (DP vs
# token-based vs fixed-size), schedule (1F1B only vs 1F1B + memory-aware adaptive), micro-batch
# ordering (as partitioned vs searched), recompute choice (per batch vs always none / always full).
# The variants are planner internals with no trainer flag, so this always simulates.
#   run_ablation.sh [--simulate] [--force] [--config experiment_configs/X.json]
source "$(dirname "$0")/_common.sh"
if [ "$MODE" = --live ]; then
  echo "run_ablation.sh: the ablation variants have no trainer flag; running it with --simulate" >&2
fi
exp ablation --simulate "${EXTRA[@]}"
