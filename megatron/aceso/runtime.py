"""Run an Aceso JSON configuration on the existing executor (``--aceso-config FILE``, GPT or T5).

What is supported: per-stage layer counts (stage cuts on layer boundaries), per-layer
recompute taken from the per-op ``recompute_ops`` flags, the global batch, and per-stage TP
and DP sizes. When every stage has the same (TP, DP) the run is an ordinary Megatron layout
(``--pipeline-stage-layers``; the micro-batch is Aceso's pipeline micro-batch divided by DP).
When they differ, stage s runs on TP_s x DP_s contiguous ranks, ``--micro-batch-size`` is
Aceso's pipeline micro-batch (each stage splits it over its DP ranks), and the static 1F1B
plans are rewritten per global rank with multi-peer, row-sliced sends and receives
(megatron/planner/passes/layout.py); the executor, validator and trainer are the usual ones.

T5 configs (encoder and decoder ops, megatron/aceso/t5_layout.py) run on pretrain_t5.py the
same way: stage cuts on layer boundaries of the sequence encoder layers, then decoder layers.

Not supported (rejected with a message): op-level TP/DP changes inside a stage, stage cuts
inside a layer, recompute of the embedding / head operators.

Recompute runs as the search priced it: each layer recomputes exactly the operators its
``recompute_ops`` flags name (megatron/core/recompute.py), every run of consecutive flagged
operators one checkpoint segment that keeps its inputs (``none``, ``selective`` = core
attention and ``full`` = the whole layer are the named special cases). Aceso's four
core-attention operators (score, softmax, dropout, context) are one fused kernel here, so
flagging any of them recomputes all four. The numerics are identical in every mode; only
memory and time differ.
"""
from __future__ import annotations

import json
from typing import Any, Dict

from megatron.aceso.layout import (ACESO_GPT_LAYER_OPS, HEAD_OPS, OUR_GPT_LAYER_OPS, TAIL_OPS,  # noqa: F401
                                   AcesoConfigError, AcesoLayout, layer_mode, make_layout, stage_shapes)
from megatron.aceso.t5_layout import t5_layout


def gpt_layout(d: Dict[str, Any], num_layers: int, world_size: int) -> AcesoLayout:
    """Translate an Aceso config dict into our GPT run layout, or explain why it cannot run."""
    flag = "--aceso-config"
    if d.get("model_name", "gpt") != "gpt":
        raise AcesoConfigError(f"{flag}: model_name {d.get('model_name')!r} is not a GPT config; T5 configs "
                               f"run on pretrain_t5.py")
    cfg_layers = d.get("num_layers")
    if cfg_layers is not None and cfg_layers != num_layers:
        raise AcesoConfigError(f"{flag}: the config is for {cfg_layers} layers but --num-layers is "
                               f"{num_layers}")
    S = d["num_stages"]
    counts = d["num_ops_in_each_stage"]
    total = sum(counts)
    per_layer, rem = divmod(total - HEAD_OPS - TAIL_OPS, num_layers)
    if rem or per_layer not in (len(ACESO_GPT_LAYER_OPS), len(OUR_GPT_LAYER_OPS)):
        raise AcesoConfigError(f"{flag}: {total} ops do not make {num_layers} GPT layers of "
                               f"{len(ACESO_GPT_LAYER_OPS)} (Aceso) or {len(OUR_GPT_LAYER_OPS)} "
                               f"(our profiler) ops plus {HEAD_OPS + TAIL_OPS} head/tail ops")
    names = ACESO_GPT_LAYER_OPS if per_layer == len(ACESO_GPT_LAYER_OPS) else OUR_GPT_LAYER_OPS
    shapes = stage_shapes(d, world_size)
    # stage cuts must fall on layer boundaries
    stage_layers, start = [], 0
    for s, c in enumerate(counts):
        end = start + c
        body_start = max(start - HEAD_OPS, 0)
        body_end = min(end - HEAD_OPS, num_layers * per_layer)
        if (s > 0 and (start - HEAD_OPS) % per_layer) or (s < S - 1 and (end - HEAD_OPS) % per_layer):
            raise AcesoConfigError(f"{flag}: stage {s} (ops {start}-{end}) is cut inside a layer; the "
                                   f"runtime needs stage cuts on layer boundaries")
        n = (body_end - body_start) // per_layer
        if n < 1:
            raise AcesoConfigError(f"{flag}: stage {s} holds no whole layer")
        stage_layers.append(n)
        start = end
    flags = [int(f) for st in d["recompute_ops"] for f in st]
    if any(flags[:HEAD_OPS]) or any(flags[total - TAIL_OPS:]):
        raise AcesoConfigError(f"{flag}: recomputing the embedding or the head operators is not "
                               f"supported; clear their recompute_ops flags")
    rec = []
    for j in range(num_layers):
        a = HEAD_OPS + j * per_layer
        rec.append(layer_mode(names, flags[a:a + per_layer]))
    return make_layout(d, shapes, stage_layers, rec)


def load_layout(path: str, layers, world_size: int) -> AcesoLayout:
    """The layout of the config at `path`: `layers` is GPT's layer count or T5's (encoder, decoder)."""
    from megatron.aceso.config import _LAYOUT_FIELDS, check_plan_fields
    with open(path) as f:
        try:
            d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise AcesoConfigError(f"--aceso-config {path}: not a JSON Aceso config ({e})") from None
    try:
        check_plan_fields(d, _LAYOUT_FIELDS)
    except ValueError as e:
        raise AcesoConfigError(f"--aceso-config {path}: {e}") from None
    if isinstance(layers, tuple):
        return t5_layout(d, *layers, world_size)
    return gpt_layout(d, layers, world_size)


def load_gpt_layout(path: str, num_layers: int, world_size: int) -> AcesoLayout:
    return load_layout(path, num_layers, world_size)


def apply_to_args(args, model_type: str, world_size: int, defaults: Dict[str, Any]) -> None:
    """Fill the parsed flags from ``args.aceso_config``; flags the user set to something else
    are an error naming both."""
    if model_type == "t5":
        enc = args.encoder_num_layers if args.encoder_num_layers is not None else args.num_layers
        dec = args.decoder_num_layers if args.decoder_num_layers is not None else enc
        if enc is None:
            raise AcesoConfigError("--aceso-config needs --encoder-num-layers / --decoder-num-layers (or --num-layers)")
        layers = (enc, dec)
    elif args.num_layers is None:
        raise AcesoConfigError("--aceso-config needs --num-layers")
    else:
        layers = args.num_layers
    for other in ("recompute_granularity", "pipeline_stage_layers", "num_layers_per_virtual_pipeline_stage"):
        if getattr(args, other, None) is not None:
            raise AcesoConfigError(f"--aceso-config sets the stage layout and recompute itself; drop "
                                   f"--{other.replace('_', '-')}")
    lay = load_layout(args.aceso_config, layers, world_size)
    for dest, value in (("tensor_model_parallel_size", lay.tp), ("pipeline_model_parallel_size", lay.pp),
                        ("micro_batch_size", lay.micro_batch_size),
                        ("global_batch_size", lay.global_batch_size)):
        cur = getattr(args, dest)
        if cur != defaults.get(dest) and cur != value:
            raise AcesoConfigError(f"--{dest.replace('_', '-')} {cur} conflicts with --aceso-config "
                                   f"({value}); drop the flag")
        setattr(args, dest, value)
    args.pipeline_stage_layers = lay.stage_layers if lay.pp > 1 else None
    # DynaPipe picks each iteration's recompute level; a config without recompute leaves it that choice.
    dyn = getattr(args, "dynapipe", False) and all(r == "none" for r in lay.recompute_layers)
    args.recompute_layers = None if dyn else lay.recompute_layers
    args.stage_parallel = lay.stage_parallel

