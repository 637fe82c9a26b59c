#!/usr/bin/env bash
# Benchmark the grid search's winners: experiments/best_throughput.jsonl (each system at its own
# best configuration) and experiments/controlled_baseline.jsonl (baselines at DynaPipe's PP x TP x
# DP); prints the throughput / speed-up table.
#   run_benchmark.sh [--simulate | --live] [--force] [--config experiment_configs/X.json]
source "$(dirname "$0")/_common.sh"
[ "$MODE" = --live ] && need_sample_data
exp benchmark "$MODE" "${EXTRA[@]}"
