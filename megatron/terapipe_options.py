"""--terapipe's options, checked where the configuration is: the slice spec
(`--terapipe-slices auto|N|l1,l2,...`) and the flag combinations TeraPipe cannot run. The
planner (megatron/planner/terapipe.py) imports these; nothing here imports the planner, so the
configuration layer does not depend on a planner."""
from __future__ import annotations

from typing import List, Optional

SLICE_GRID = 8


# ---------------------------------------------------------------------------- slicing options
def uniform_slices(seq_len: int, n: int) -> List[int]:
    """n slices as equal as the grid of 8 tokens allows (the remainder goes to the first)."""
    if n < 1 or n > seq_len:
        raise ValueError(f"--terapipe-slices {n}: need 1 <= N <= sequence length {seq_len}")
    if seq_len % SLICE_GRID == 0 and n <= seq_len // SLICE_GRID:
        cells = seq_len // SLICE_GRID
        sizes = [cells // n * SLICE_GRID] * n
        for i in range(cells % n):
            sizes[i] += SLICE_GRID
        return sizes
    sizes = [seq_len // n] * n
    sizes[0] += seq_len - sum(sizes)
    return sizes


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
def check_terapipe_config(cfg) -> None:
    """Flag combinations --terapipe cannot run (ValueError, which config.py reports as a
    ConfigError); each error names the flag and the way out."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data

    def need(ok, msg):
        if not ok:
            raise ValueError(msg)

    need(m.model_type == "gpt",
         "--terapipe slices the tokens of a causal decoder (GPT): each slice attends only to earlier tokens. "
         "T5's encoder attends in both directions and its decoder cross-attends to the whole encoder output, "
         "so a T5 slice would need tokens that run later; use pretrain_gpt.py or drop --terapipe")
    need(not d.dynapipe, "--terapipe and --dynapipe are two planners for one run; pick one")
    need(not d.targets_data_path and not d.pack_dataset,
         "--terapipe trains on pretraining data (--data-path or --mock-data); multi-task data "
         "(--targets-data-path / --pack-dataset) is not supported with it")
    need(p.num_layers_per_virtual_pipeline_stage is None,
         "--terapipe runs one stage per pipeline rank: drop --num-layers-per-virtual-pipeline-stage")
    need(not m.sequence_parallel,
         "--terapipe with --sequence-parallel would split each token slice over TP ranks; drop --sequence-parallel "
         "(TeraPipe already bounds activation memory by slicing the sequence)")
    need(not cfg.compression.inter_grad_comp,
         "--terapipe with --inter-grad-comp is not supported: compressed backpropagation keeps one low-rank state "
         "per stage and micro-batch shape, and token slices change shape every slice; drop one of them")
    need(t.recompute_granularity != "full",
         "--terapipe with --recompute-granularity full would replay a layer and write its slice's keys/values "
         "twice: use --recompute-granularity selective or none")
    need(all(mode in ("none", "selective") for mode in t.recompute_layers or ()),
         "--terapipe with an --aceso-config whose recompute_ops replay more than core attention would write a "
         "slice's keys/values twice: clear those flags (core attention alone may stay) or drop --terapipe")
    parse_slices(cfg.terapipe.slices, m.seq_length)
