"""Which layers each DynaPipe pipeline stage holds (`DynaPipeConfig.stage_layers`), kept apart from
the planner so its cost code stays short.

GPT: `num_layers` split evenly over the stages, `layers_per_stage` each, or the explicit
`stage_layer_counts` of an Aceso layout. T5: encoder stages, then decoder stages, half of the
pipeline each; or explicit counts over the layer sequence encoder layers, then decoder layers
(Aceso's cuts: one stage may end the encoder and start the decoder).
"""
from __future__ import annotations

from typing import List, Tuple

Layout = List[List[Tuple[str, int]]]


def stage_components(cfg) -> Layout:
    """Per stage: [(component, layer count)]. The last stage also runs the output head."""
    P = cfg.pipeline_parallel
    if cfg.stage_layer_counts is not None:
        E = cfg.encoder_layers if cfg.model_kind == "t5" else sum(cfg.stage_layer_counts)
        out, start = [], 0
        for n in cfg.stage_layer_counts:
            end = start + int(n)
            comps = [("encoder", min(end, E) - start)] if start < E else []
            out.append(comps + ([("decoder", end - max(start, E))] if end > E else []))
            start = end
        return out
    if cfg.model_kind == "gpt":
        n = cfg.layers_per_stage or cfg.num_layers // P
        if n < 1 or (cfg.layers_per_stage is None and cfg.num_layers % P):
            raise ValueError(f"{cfg.num_layers} GPT layers do not split evenly over {P} stages; set layers_per_stage")
        return [[("encoder", n)] for _ in range(P)]
    if P == 1:
        return [[("encoder", cfg.layers_per_stage or cfg.encoder_layers),
                 ("decoder", cfg.layers_per_stage or cfg.decoder_layers)]]
    half = P // 2
    ne = cfg.layers_per_stage or cfg.encoder_layers // half
    nd = cfg.layers_per_stage or cfg.decoder_layers // half
    if ne < 1 or nd < 1:
        raise ValueError(f"T5 needs encoder_layers and decoder_layers >= {half} (one per stage)")
    return [[("encoder", ne)]] * half + [[("decoder", nd)]] * half


def t5_split(layout: Layout) -> Tuple[int, int]:
    """(first stage with a decoder layer, last stage with an encoder layer) of a T5 layout."""
    first_dec = next(s for s, comps in enumerate(layout) if any(c == "decoder" for c, _ in comps))
    last_enc = max(s for s, comps in enumerate(layout) if any(c == "encoder" for c, _ in comps))
    return first_dec, last_enc
