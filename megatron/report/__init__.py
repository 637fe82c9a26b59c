"""`python -m megatron.report RUN_DIR`: plots and a Markdown summary of a training run.

Reads what the trainer writes: TensorBoard scalars (--tensorboard-dir; `lm loss`,
`lm loss validation`, `throughput/tokens-per-second`, `iteration-time`, `planner/simulated_ms`,
and any `memory/...` series), the checkpoint tracker, and pipeline timelines
(--pipeline-timeline / --dynapipe-trace-dir: `iter_N.measured.json` beside `iter_N.sim.json`).
"""
