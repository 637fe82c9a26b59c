#!/usr/bin/env bash
# Grid search per setting (model x max length x cluster size of the grid file): the baselines
# (packing, fixed micro-batches) over PP x TP x DP x micro-batch size x recompute, DynaPipe over
# PP x TP x DP. Rows -> experiments/grid_search.jsonl; the winners ->
# experiments/{best,control,ablation}_configs/<grid>/<setting>.json (the shipped ones in
# experiment_configs/ are inputs, read by the benchmark when a grid has no search of its own).
#   run_grid_search.sh [--simulate | --live] [--force] [--config experiment_configs/X.json]
# --simulate (default without a GPU): planner simulator + the grid's cost model.
# --live: torchrun pretrain_gpt.py / pretrain_t5.py per job (default grid: the CPU smoke grid).
source "$(dirname "$0")/_common.sh"
[ "$MODE" = --live ] && need_sample_data
exp grid-search "$MODE" "${EXTRA[@]}"
