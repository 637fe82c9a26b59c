"""What an Aceso configuration becomes for the runtime (megatron/aceso/runtime.py for GPT,
megatron/aceso/t5_layout.py for T5): the layout record, its error type, and the per-stage
(TP, DP) sizes and recompute settings both model families read the same way."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from megatron.core import recompute as rc

# Layer operator names by ops per layer: Aceso's CUDA tables (13) and our profiler's (10).
ACESO_GPT_LAYER_OPS = list(rc.ACESO_LAYER_OPS)
OUR_GPT_LAYER_OPS = list(rc.LAYER_OPS)
HEAD_OPS, TAIL_OPS = 1, 2  # embedding; final layernorm + post-process


class AcesoConfigError(ValueError):
    pass


@dataclass
class AcesoLayout:
    tp: int
    pp: int
    dp: int
    stage_layers: List[int]
    recompute_layers: List[str]   # per global layer: none | selective | full | '+'-joined operators
    micro_batch_size: int         # per DP rank; the pipeline micro-batch when stage_parallel is set
    global_batch_size: int
    stage_parallel: Optional[List[List[int]]] = None  # [TP, DP] per stage when they differ


def layer_mode(names: List[str], flags: List[int]) -> str:
    """The layer's recompute setting (megatron/core/recompute.py) for its per-op flags."""
    return rc.encode(rc.from_flags(names, flags))


def stage_shapes(d: Dict[str, Any], world_size: int) -> List[tuple]:
    """(TP, DP) of each stage, checked against the job size."""
    flag, S = "--aceso-config", d["num_stages"]
    tps = [set(x) for x in d["model_parallel_size_of_each_op"]]
    dps = [set(x) for x in d["data_parallel_size_of_each_op"]]
    for s in range(S):
        if len(tps[s]) != 1 or len(dps[s]) != 1:
            raise AcesoConfigError(f"{flag}: stage {s} changes TP/DP between its ops; the runtime "
                                   f"runs one TP and DP size per stage")
    shapes = [(next(iter(t)), next(iter(p))) for t, p in zip(tps, dps)]
    if sum(t * p for t, p in shapes) != world_size:
        desc = " + ".join(f"TP {t} x DP {p}" for t, p in shapes)
        raise AcesoConfigError(f"{flag}: the {S} stages need {desc} = {sum(t * p for t, p in shapes)} ranks, but "
                               f"the job has {world_size}")
    return shapes


def make_layout(d: Dict[str, Any], shapes: List[tuple], stage_layers: List[int], rec: List[str]) -> AcesoLayout:
    """The run layout: an ordinary Megatron one when every stage has one (TP, DP), else per-stage sizes."""
    mbs, S = int(d["micro_batch_size"]), len(shapes)
    for s, (_, p) in enumerate(shapes):
        if mbs % p:
            raise AcesoConfigError(f"--aceso-config: micro_batch_size {mbs} is not divisible by stage {s}'s DP {p}")
    tp, dp = shapes[0]
    if len(set(shapes)) != 1:
        return AcesoLayout(max(t for t, _ in shapes), S, 1, stage_layers, rec, mbs, int(d["global_batch_size"]),
                           [[t, p] for t, p in shapes])
    return AcesoLayout(tp, S, dp, stage_layers, rec, mbs // dp, int(d["global_batch_size"]))
