"""Experiment drivers that regenerate the DynaPipe figures (grid search, benchmark, ablation,
Figs 13-18) with a `simulate` back-end (planner simulator + cost model) or a `live` one
(torchrun runs of pretrain_gpt.py / pretrain_t5.py). CLI: `python -m megatron.experiments`."""
