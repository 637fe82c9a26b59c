#!/usr/bin/env bash
# Fig 18 (cost-model accuracy: predicted vs measured time and memory, from live rows)
# from experiments/*.jsonl -> reproduced_figures/fig<N>_*.png (+ the data as .csv beside each).
#   generate_figure_18.sh [--simulate | --live]   (which back-end's rows to draw)
# Needs matplotlib (pip install -e .[experiments]); without it only the CSVs are written and the
# script says so (exit status 3).
source "$(dirname "$0")/_common.sh"
exp figures "$MODE" --fig 18 "${EXTRA[@]}"
