"""--terapipe's options, checked where the configuration is: the slice spec
(`--terapipe-slices auto|N|l1,l2,...`) and the flag combinations TeraPipe cannot run. The
planner (megatron/planner/terapipe/lowering.py) imports these; nothing here imports the planner, so the
configuration layer does not depend on a planner."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

SLICE_GRID = 8


# ---------------------------------------------------------------------------- slicing options
def uniform_slices(seq_len: int, n: int, grid: int = SLICE_GRID) -> List[int]:
    """n slices as equal as the grid of `grid` tokens allows (the remainder goes to the first)."""
    if n < 1 or n > seq_len:
        raise ValueError(f"--terapipe-slices {n}: need 1 <= N <= sequence length {seq_len}")
    if seq_len % grid == 0 and n <= seq_len // grid:
        cells = seq_len // grid
        sizes = [cells // n * grid] * n
        for i in range(cells % n):
            sizes[i] += grid
        return sizes
    sizes = [seq_len // n] * n
    sizes[0] += seq_len - sum(sizes)
    return sizes


def slice_offsets(lengths: Sequence[int]) -> List[int]:
    """First token position of each slice of a sequence cut into `lengths` (its context)."""
    out, at = [], 0
    for ln in lengths:
        out.append(at)
        at += int(ln)
    return out


def parse_slices(spec: str, seq_len: int) -> Optional[List[int]]:
    """'auto' -> None (plan with the DP); 'N' -> N uniform slices; 'l1,l2,...' -> those."""
    spec = spec.strip()
    if spec == "auto":
        return None
    try:
        parts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--terapipe-slices {spec!r}: expected 'auto', a count N or lengths l1,l2,...") from None
    if len(parts) == 1 and "," not in spec:
        return uniform_slices(seq_len, parts[0])
    if any(p <= 0 for p in parts) or sum(parts) != seq_len:
        raise ValueError(f"--terapipe-slices {spec}: lengths must be positive and sum to --seq-length {seq_len} "
                         f"(they sum to {sum(parts)})")
    return parts



# ---------------------------------------------------------------------------- flags
T5_REFUSAL = ("--terapipe slices the tokens of a causal decoder (GPT): each slice attends only to earlier tokens. "
              "T5's encoder attends in both directions and its decoder cross-attends to the whole encoder output, "
              "so a T5 slice would need tokens that run later; use pretrain_gpt.py or drop --terapipe")


def check_terapipe_config(cfg) -> None:
    """Flag combinations --terapipe cannot run (ValueError, which config.py reports as a
    ConfigError); each error names the flag and the way out."""
    m, p, d = cfg.model, cfg.parallel, cfg.data

    def need(ok, msg):
        if not ok:
            raise ValueError(msg)

    need(m.model_type == "gpt", T5_REFUSAL)
    if d.dynapipe:  # DynaPipe's micro-batches cut into token slices (megatron/planner/dynapipe/slicing.py)
        return check_dynapipe_slicing(cfg)
    need(all(mode in ("none", "selective", "full") for mode in cfg.training.recompute_layers or ()),
         "--terapipe with an --aceso-config whose recompute_ops replay part of a layer (more than core attention, "
         "less than all of it) would write a slice's keys/values into the cache again on replay: clear those "
         "flags or set whole layers, or drop --terapipe")
    fixed = parse_slices(cfg.terapipe.slices, m.seq_length)
    # stages with their own TP sizes (--aceso-config) each split a slice over their own TP ranks
    tps = sorted({t for t, _ in p.stage_parallel}) if p.stage_parallel else [p.tensor_model_parallel_size]
    tp = math.lcm(*tps)
    if m.sequence_parallel and tp > 1 and fixed is not None:
        need(all(ln % tp == 0 for ln in fixed),
             f"--sequence-parallel splits each token slice over the TP ranks ({'/'.join(map(str, tps))}): "
             f"--terapipe-slices {cfg.terapipe.slices} gives {fixed}, give lengths that are multiples of {tp}")


def check_dynapipe_slicing(cfg) -> None:
    """`--dynapipe --terapipe`: what the sliced DynaPipe planner cannot run (multi-task data is
    its input; GPT and one stage per rank were checked by the caller / --dynapipe)."""
    d = cfg.data
    spec = cfg.terapipe.slices.strip()
    if spec != "auto" and not spec.isdigit() or spec == "0":
        raise ValueError(f"--terapipe-slices {spec} with --dynapipe: give auto (the planner decides) or a count N "
                         "(N uniform slices per micro-batch); lengths l1,l2,... cannot fit micro-batches whose "
                         "length the planner picks per iteration")
    if d.dynapipe_packed_rows:
        raise ValueError("--dynapipe-packed-rows with --terapipe: token slices run the sliced causal attention, "
                         "which masks by token position only, so a slice of a packed row would attend across its "
                         "documents (the executor refuses segment ids in slices); drop one of them")
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError("--dynapipe --terapipe with --num-layers-per-virtual-pipeline-stage: the sliced planner "
                         "pipelines each micro-batch's slices over one stage per rank, which fills the pipeline as "
                         "virtual stages would; drop --num-layers-per-virtual-pipeline-stage, or drop --dynapipe "
                         "(plain --terapipe runs slices on virtual stages)")
    # --sequence-parallel: slices on a grid of lcm(8, TP) tokens, split over the TP ranks
    # (megatron/planner/dynapipe/slicing.py `_grid`, `_seq_split`).
