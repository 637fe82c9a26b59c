"""--pipeline-schedule's values and the checks they need (zero-bubble schedules split the
backward into input and weight passes: megatron/planner/schedule/zero_bubble.py)."""
from __future__ import annotations

from megatron.config.errors import _require

# Split-backward schedules; the V ones place two stages per rank (rank r: stages r, 2 PP - 1 - r).
SPLIT_SCHEDULES = ("zb-h1", "zb-h2", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")
PIPELINE_SCHEDULES = ("1f1b", "gpipe") + SPLIT_SCHEDULES


def check_parallel_schedule(p) -> None:
    """What a schedule needs from the parallel layout alone (`ParallelConfig`)."""
    _require(p.pipeline_schedule in PIPELINE_SCHEDULES,
             f"--pipeline-schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {p.pipeline_schedule!r}")
    if p.pipeline_schedule in SPLIT_SCHEDULES:
        _require(p.num_layers_per_virtual_pipeline_stage is None,
                 f"--pipeline-schedule {p.pipeline_schedule} places its own stages (zb-v, dualpipev: two per rank "
                 "in a V): drop --num-layers-per-virtual-pipeline-stage")
        _require(p.stage_parallel is None,
                 f"--pipeline-schedule {p.pipeline_schedule} runs stages with one TP/DP size: drop the "
                 "per-stage TP x DP sizes or use --pipeline-schedule 1f1b")


def check_schedule_config(cfg) -> None:
    """What a schedule needs from the rest of the configuration (`MegatronConfig`)."""
    m, p = cfg.model, cfg.parallel
    sched = p.pipeline_schedule
    if sched in SPLIT_SCHEDULES:
        _require(not cfg.terapipe.enabled,
                 f"--pipeline-schedule {sched} splits the backward, which token slices cannot (their "
                 "key/value gradients flow between the slices' backwards): drop --terapipe or use 1f1b")
    if sched in V_SCHEDULES:
        _require(not cfg.data.dynapipe, f"--pipeline-schedule {sched}: --dynapipe plans one stage per pipeline "
                 "rank: with it use --pipeline-schedule zb-h1 (DynaPipe then places split backwards' weight passes "
                 "itself)")
        _require(m.model_type == "gpt", f"--pipeline-schedule {sched} runs GPT: T5 splits its pipeline at "
                 "--pipeline-model-parallel-split-rank, which a V placement cannot keep; use zb-h1 or zb-h2")
        _require(m.num_layers % (2 * p.pipeline_model_parallel_size) == 0 or p.pipeline_stage_layers is not None,
                 f"--pipeline-schedule {sched} cuts --num-layers ({m.num_layers}) into 2 x "
                 f"--pipeline-model-parallel-size ({p.pipeline_model_parallel_size}) stages: make it divisible")
        _require(p.pipeline_stage_layers is None, f"--pipeline-schedule {sched} splits the layers evenly over its "
                 "2 x PP stages: drop --pipeline-stage-layers")


_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe (all forwards, then all backwards)",
          "zb-h1": "zero bubble ZB-H1 (split backward)", "zb-h2": "zero bubble ZB-H2 (split backward)",
          "zb-v": "zero bubble ZB-V (two stages per rank in a V, split backward)"}


def schedule_description(cfg, pp_size: int) -> str:
    """The pipeline schedule this configuration runs, in words, for the run's first log lines."""
    p = cfg.parallel
    if pp_size <= 1:
        return "no pipeline (PP=1): micro-batches run one after another with gradient accumulation"
    name = _NAMES.get(p.pipeline_schedule, p.pipeline_schedule)
    if p.num_layers_per_virtual_pipeline_stage is not None:
        name = f"interleaved {name} ({p.num_layers_per_virtual_pipeline_stage} layers per virtual stage)"
    if cfg.data.dynapipe:
        name = f"DynaPipe: planned per iteration (micro-batches, order and recompute), {name} as the base"
    if cfg.terapipe.enabled:
        name += f", TeraPipe token slices ({cfg.terapipe.slices})"
    return f"{name} over {pp_size} stages"
