"""The model pieces the cost model prices, built from the real model code for one TP rank.

* ``encoder``: a stack of `TransformerLayer`s (GPT layer, or T5 encoder layer: not causal);
* ``decoder``: T5 decoder layers (causal self-attention + cross-attention over the encoder
  output);
* ``preprocess``: the word (+ position) embedding and its dropout, i.e. what the first stage
  runs before its layers (T5: also the first decoder stage, on the decoder length);
* ``postprocess``: final norm + output head + vocab-parallel loss, i.e. a `GPTStage` with no
  layers and only `post_process` (the exact code the last pipeline stage runs).

Several layers are stacked per measurement (overheads amortise; the layer-to-layer hand-off
is part of what a layer costs) and the caller divides by the count.
"""
from __future__ import annotations

import torch

from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.models.gpt import GPTEmbedding, GPTStage
from megatron.models.t5 import _layers as t5_layers
from megatron.models.transformer import TransformerBlock, TransformerLayer
from megatron.profiling.measure import Workload


def param_bytes(module: torch.nn.Module) -> tuple:
    """(parameter count, bytes) held by this rank."""
    ps = list(module.parameters())
    return sum(p.numel() for p in ps), sum(p.numel() * p.element_size() for p in ps)


def build_layers(cfg: ModelConfig, ps: ParallelState, component: str, n: int, seed: int) -> TransformerBlock:
    decoder = component == "decoder"
    if cfg.model_type == "t5":  # T5's own layers: relative position bias per layer, as T5Stage builds them
        total = cfg.decoder_num_layers if decoder else cfg.encoder_num_layers
        return TransformerBlock(t5_layers(cfg, ps, 0, n, decoder=decoder, seed=seed, total=max(total, n)))
    causal = cfg.model_type == "gpt" or decoder
    layers = [TransformerLayer(cfg, ps.tp_group, layer_number=i, num_layers_total=n, seed=seed,
                               key=f"{component}.layers.{i}", causal=causal, decoder=decoder)
              for i in range(n)]
    return TransformerBlock(layers)


def build_postprocess(cfg: ModelConfig, ps: ParallelState, seed: int) -> GPTStage:
    return GPTStage(cfg, ps, layer_start=0, layer_end=0, pre_process=False, post_process=True, seed=seed)


def build_embedding(cfg: ModelConfig, ps: ParallelState, seed: int) -> GPTEmbedding:
    return GPTEmbedding(cfg, ps, cfg.padded_vocab_size(ps.tp_size), seed)


def _hidden(s, b, cfg, device, dtype):
    return torch.randn(s, b, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)


def layer_workload(block: TransformerBlock, cfg: ModelConfig, recompute: str, mbs: int, seq: int,
                   device, dtype, dec_seq: int | None = None) -> Workload:
    """Forward of the stack on a [seq, mbs, hidden] input that needs its gradient (as on every
    pipeline stage after the first). Decoder: `seq` is the encoder length, `dec_seq` the
    decoder's; the encoder output is shared by all decoder layers, so no layer owns it."""
    if dec_seq is None:
        return Workload(block, lambda: (_hidden(seq, mbs, cfg, device, dtype),),
                        lambda x: block(x, recompute=recompute))
    return Workload(block,
                    lambda: (_hidden(dec_seq, mbs, cfg, device, dtype), _hidden(seq, mbs, cfg, device, dtype)),
                    lambda x, enc: block(x, None, enc, None, recompute=recompute),
                    shared=lambda ins: [ins[1]])


def packed_layer_workload(block: TransformerBlock, cfg: ModelConfig, recompute: str, mbs: int, seq: int,
                          docs: int, device, dtype) -> Workload:
    """The stack on `mbs` packed rows of `seq` tokens, each holding `docs` equal documents, run
    by the variable-length kernel (as training runs --pack-dataset rows): attention work
    mbs * docs * (seq / docs)^2."""
    from megatron.fused_kernels import ops
    from megatron.models.packed_attention import PackedSegments
    seg = torch.arange(seq).div(seq // docs, rounding_mode="floor").clamp(max=docs - 1).add(1).expand(mbs, seq)
    packed = PackedSegments(ops.cu_seqlens_from_segment_ids(seg).to(device), mbs, seq)
    return Workload(block, lambda: (_hidden(seq, mbs, cfg, device, dtype),),
                    lambda x: block(x, packed, recompute=recompute))


def preprocess_workload(emb: GPTEmbedding, cfg: ModelConfig, mbs: int, seq: int, device) -> Workload:
    """The first stage's embedding on [mbs, seq] token ids (nothing owned: ids are not activations)."""
    def make():
        tokens = torch.randint(0, cfg.vocab_size, (mbs, seq), device=device)
        return tokens, torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)

    return Workload(emb, make, lambda tokens, pos: emb(tokens, pos), owned_input=lambda ins: None)


def postprocess_workload(stage: GPTStage, cfg: ModelConfig, mbs: int, seq: int, device, dtype) -> Workload:
    def make():
        labels = torch.randint(0, cfg.vocab_size, (mbs, seq), device=device)
        return _hidden(seq, mbs, cfg, device, dtype), labels

    return Workload(stage, make, lambda x, labels: stage({"labels": labels}, [x])[0])
