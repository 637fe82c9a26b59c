"""How many transformer layers each pipeline stage holds. The model builders need it to build a
stage, the planners to price one; it lives here, below both."""
from __future__ import annotations

from typing import Optional, Sequence, Union


def stage_layer_split(num_layers: int, num_stages: int,
                      explicit: Optional[Union[str, Sequence[int]]] = None) -> list[int]:
    """Layers per (virtual) pipeline stage.

    Uniform by default: `num_layers` (--num-layers) must divide by `num_stages`
    (--pipeline-model-parallel-size times the number of model chunks, where
    --num-layers-per-virtual-pipeline-stage sets the chunks). An explicit split such as
    ``"3,5"`` (flag --pipeline-stage-layers) gives every stage its own count; it must have
    one positive entry per stage and sum to --num-layers.
    """
    if num_stages < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {num_stages} "
                         "(--pipeline-model-parallel-size)")
    if explicit is not None:
        try:
            split = ([int(x) for x in explicit.split(",")] if isinstance(explicit, str)
                     else [int(x) for x in explicit])
        except ValueError:
            raise ValueError(f"--pipeline-stage-layers {explicit!r} must be comma-separated "
                             "integers, one per pipeline stage, e.g. '3,5'") from None
        if len(split) != num_stages:
            raise ValueError(f"--pipeline-stage-layers {explicit!r} has {len(split)} entries "
                             f"but there are {num_stages} pipeline stages "
                             "(--pipeline-model-parallel-size x virtual chunks)")
        if any(n < 1 for n in split):
            raise ValueError(f"--pipeline-stage-layers {explicit!r}: every stage needs at "
                             "least one layer")
        if sum(split) != num_layers:
            raise ValueError(f"--pipeline-stage-layers {explicit!r} sums to {sum(split)} "
                             f"layers, but --num-layers is {num_layers}")
        return split
    if num_layers % num_stages:
        raise ValueError(f"--num-layers {num_layers} is not divisible by the {num_stages} "
                         "pipeline stages (--pipeline-model-parallel-size x model chunks from "
                         "--num-layers-per-virtual-pipeline-stage); pass an explicit split "
                         "with --pipeline-stage-layers")
    return [num_layers // num_stages] * num_stages
