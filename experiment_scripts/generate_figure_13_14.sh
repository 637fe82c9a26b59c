#!/usr/bin/env bash
# Fig 13 (throughput, best configuration per system) and Fig 14 (baselines at DynaPipe's parallelism)
# from experiments/*.jsonl -> reproduced_figures/fig<N>_*.png (+ the data as .csv beside each).
#   generate_figure_13_14.sh [--simulate | --live]   (which back-end's rows to draw)
# Needs matplotlib (pip install -e .[experiments]); without it only the CSVs are written and the
# script says so (exit status 3).
source "$(dirname "$0")/_common.sh"
exp figures "$MODE" --fig 13,14 "${EXTRA[@]}"
