"""An Aceso T5 configuration as a run layout (``pretrain_t5.py --aceso-config FILE``).

Aceso's T5 op list: ``encoder-embedding``, 13 ops per encoder layer, ``enc-final-layernorm``,
``decoder-embedding``, 21 ops per decoder layer (self-attention, cross-attention, MLP),
``dec-final-layernorm``, ``t5-post-process``. Our stages hold whole layers of the sequence
encoder 0..E-1, decoder 0..D-1 (``--pipeline-stage-layers`` for T5, megatron/models/t5.py), so
each op between layers runs with its neighbouring layer: the encoder embedding with the first
encoder layer, its final norm with the last, the decoder embedding with the first decoder layer
and the head with the last. A cut may fall anywhere between two layers (on either side of
those ops); the stage holding the first decoder layer also receives the encoder output, and
every later stage passes it on with the decoder hidden states (each decoder layer cross-attends
to it). Encoder layers recompute any operator set (megatron/core/recompute.py); a decoder layer
is one fused unit apart from its two attention cores, so it recomputes none, both cores
(``selective``) or everything (``full``).
"""
from __future__ import annotations

from typing import Any, Dict, List

from megatron.aceso.layout import (ACESO_GPT_LAYER_OPS, AcesoConfigError, AcesoLayout, layer_mode, make_layout,
                                   stage_shapes)

ENC_OPS = len(ACESO_GPT_LAYER_OPS)  # 13, the same operators as a GPT layer
DEC_CORE = (2, 3, 4, 5, 10, 11, 12, 13)  # score, softmax, dropout, context of both attentions
DEC_OPS = 21


def decoder_mode(flags: List[int], where: str) -> str:
    if not any(flags):
        return "none"
    if all(flags):
        return "full"
    if {i for i, f in enumerate(flags) if f} == set(DEC_CORE):
        return "selective"
    raise AcesoConfigError(f"--aceso-config: {where} flags ops {[i for i, f in enumerate(flags) if f]} of its "
                           f"{DEC_OPS}; a T5 decoder layer here recomputes none, both attention cores "
                           f"({list(DEC_CORE)}) or all of them")


def t5_layout(d: Dict[str, Any], enc: int, dec: int, world_size: int) -> AcesoLayout:
    """Translate an Aceso T5 config dict into our run layout, or explain why it cannot run."""
    flag = "--aceso-config"
    if d.get("model_name") != "t5":
        raise AcesoConfigError(f"{flag}: model_name {d.get('model_name')!r} is not a T5 config; GPT configs run "
                               f"on pretrain_gpt.py")
    cfg_layers = d.get("num_layers")
    if cfg_layers is not None and list(cfg_layers if isinstance(cfg_layers, list) else [cfg_layers]) != [enc, dec]:
        raise AcesoConfigError(f"{flag}: the config is for {cfg_layers} (encoder, decoder) layers but "
                               f"--encoder-num-layers / --decoder-num-layers are {enc} / {dec}")
    # The layer of each layer op (encoder layers 0..E-1, then decoder layers E..E+D-1); None
    # for the embedding / norm / head ops between layers, which run with a neighbouring layer.
    owner = [None] + [j for j in range(enc) for _ in range(ENC_OPS)] + [None, None] \
        + [enc + k for k in range(dec) for _ in range(DEC_OPS)] + [None, None]
    counts = d["num_ops_in_each_stage"]
    if sum(counts) != len(owner):
        raise AcesoConfigError(f"{flag}: {sum(counts)} ops do not make a T5 of {enc} encoder layers of {ENC_OPS} "
                               f"ops and {dec} decoder layers of {DEC_OPS} plus 5 embedding/norm/head ops "
                               f"({len(owner)})")
    shapes = stage_shapes(d, world_size)
    stage_layers, start = [], 0
    for s, c in enumerate(counts):
        end = start + c
        before = [o for o in owner[:end] if o is not None]
        after = [o for o in owner[end:] if o is not None]
        if before and after and before[-1] == after[0]:
            raise AcesoConfigError(f"{flag}: stage {s} (ops {start}-{end}) is cut inside layer {after[0]}; the "
                                   f"runtime needs stage cuts on layer boundaries")
        n = len({o for o in owner[start:end] if o is not None})
        if n < 1:
            raise AcesoConfigError(f"{flag}: stage {s} holds no whole layer")
        stage_layers.append(n)
        start = end
    flags = [int(f) for st in d["recompute_ops"] for f in st]
    between = [0, 1 + enc * ENC_OPS, 2 + enc * ENC_OPS, len(owner) - 2, len(owner) - 1]
    if any(flags[i] for i in between):
        raise AcesoConfigError(f"{flag}: recomputing the embeddings, final norms or head is not supported; clear "
                               f"their recompute_ops flags (ops {between})")
    rec = [layer_mode(ACESO_GPT_LAYER_OPS, flags[1 + j * ENC_OPS:1 + (j + 1) * ENC_OPS]) for j in range(enc)]
    base = 3 + enc * ENC_OPS
    rec += [decoder_mode(flags[base + k * DEC_OPS:base + (k + 1) * DEC_OPS], f"decoder layer {k}")
            for k in range(dec)]
    return make_layout(d, shapes, stage_layers, rec)
