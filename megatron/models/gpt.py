"""GPT, built one pipeline stage at a time.

A stage owns layers [layer_start, layer_end). The first stage (`pre_process`) owns the word and
position embeddings; the last (`post_process`) owns the final norm and the output head, tied to
the word embedding. With PP > 1 the last stage keeps its own copy of the word embedding, made
identical at initialisation and kept identical by reducing its gradient with the first
stage's (`megatron.core.distributed.allreduce_embedding_grads`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.core import ModelConfig
from megatron.config.schedules import V_SCHEDULES
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import (VocabParallelEmbedding, copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region, get_rng_tracker,
                                           scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.layers import init_full
from megatron.models.cp_attention import build_cp_spec
from megatron.models.layer_ops import recompute_set, unit_flags
from megatron.data.packing import packed_attention_mask
from megatron.models.packed_attention import packed_segments
from megatron.models.rotary import rotary_cos_sin
from megatron.models.transformer import TransformerBlock, TransformerLayer, build_norm

WORD_EMBEDDING_KEY = "embedding.word_embeddings"


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, padded_vocab: int, seed: int):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, ps.tp_group,
                                                      init_std=cfg.init_method_std, seed=seed,
                                                      key=WORD_EMBEDDING_KEY, real_vocab_size=cfg.vocab_size)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            pos = init_full((cfg.max_position_embeddings, cfg.hidden_size), cfg.init_method_std, seed,
                            "embedding.position_embeddings")
            self.position_embeddings = nn.Parameter(pos)
        self.dropout = cfg.hidden_dropout
        self.tp_group = ps.tp_group
        self.sequence_parallel = cfg.sequence_parallel and ps.tp_size > 1

    def forward(self, tokens, position_ids, kv_cache=None):
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:  # RoPE rotates q and k inside attention instead
            x = x + F.embedding(position_ids, self.position_embeddings)
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        keyed = kv_cache is not None and kv_cache.dropout is not None and self.training and self.dropout > 0
        if keyed:  # token slices: keyed masks over the whole slice (equal on every TP rank)
            x = kv_cache.dropout.hidden(x, self.dropout, 0, kv_cache.offset)
        if self.sequence_parallel:
            # Megatron fuses this into the embedding's reduce-scatter; an all-reduce then a split
            # moves more bytes but gives the same values and gradients.
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
            if self.dropout > 0 and self.training and not keyed:
                with get_rng_tracker().fork():
                    return F.dropout(x, self.dropout, True)
            return x
        if keyed:
            return x
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


class GPTStage(nn.Module):
    """One pipeline stage of GPT. `forward(batch, inputs)` returns the stage outputs: a list with
    the hidden states [s, b, h], or on the last stage the per-token losses [b, s] (fp32)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, *, layer_start: int, layer_end: int,
                 pre_process: bool, post_process: bool, seed: int,
                 recompute_method: Optional[str] = None, recompute_num_layers: Optional[int] = None):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_start, self.layer_end = layer_start, layer_end
        self.padded_vocab = cfg.padded_vocab_size(ps.tp_size)
        self.recompute = "none"
        self.cp_comm_type = "all_gather"  # --cp-comm-type (build_gpt_stages sets it)
        if pre_process:
            self.embedding = GPTEmbedding(cfg, ps, self.padded_vocab, seed)
        layers = [TransformerLayer(cfg, ps.tp_group, layer_number=i, num_layers_total=cfg.num_layers, seed=seed,
                                   key=f"decoder.layers.{i}", ep_group=ps.ep_group, ep_rank=ps.ep_rank)
                  for i in range(layer_start, layer_end)]
        self.sequence_parallel = cfg.sequence_parallel and ps.tp_size > 1
        self.decoder = TransformerBlock(layers, recompute_method, recompute_num_layers,
                                        sequence_parallel=self.sequence_parallel)
        if post_process:
            self.final_layernorm = build_norm(cfg, ps.tp_group)
            if cfg.untie_embeddings_and_output_weights:
                self.output_layer = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, ps.tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key="output_layer", real_vocab_size=cfg.vocab_size)
            elif not pre_process:
                # Same key as the first stage's embedding -> identical initial values.
                self.output_layer = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, ps.tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key=WORD_EMBEDDING_KEY, real_vocab_size=cfg.vocab_size)
                self.output_layer.weight.shared_embedding = True

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        if hasattr(self, "_tied_embedding_stage"):
            return self._tied_embedding_stage.embedding.word_embeddings.weight
        return self.embedding.word_embeddings.weight

    def attention_mask(self, batch) -> Optional[torch.Tensor]:
        seg = batch.get("segment_ids")
        if seg is None:
            return None
        return packed_attention_mask(seg)

    def forward(self, batch: dict, inputs: list, kv_cache=None) -> list:
        """`kv_cache` (a `SequenceKVCache` positioned on one token slice) runs the batch as that
        slice of its sequence; the batch then holds the slice's tokens and position ids."""
        pos = batch.get("position_ids")
        cp = None
        if batch.get("cp_index") is not None:  # context parallelism: this rank's two chunks of each row
            dev = (batch["tokens"] if self.pre_process else inputs[0]).device
            cp = build_cp_spec(self.cp_comm_type, self.ps, batch, dev, self.training)
        if self.pre_process:
            tokens = batch["tokens"]
            if pos is None:
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            if kv_cache is not None:
                x = self.embedding(tokens, pos, kv_cache)
            elif cp is not None and cp.dropout is not None:  # keyed by absolute token position
                x = self.embedding(tokens, pos, cp)
            else:
                x = self.embedding(tokens, pos)
        else:
            (x,) = inputs
        # packed rows: the variable-length kernel's segments, else the dense block-diagonal mask
        if cp is not None:  # per-document masks over the whole row, built in each layer's exchange
            mask = cp
        elif kv_cache is not None:  # a token slice: its queries' rows of the prefix's per-document mask
            seg = batch.get("segment_ids")
            mask = None if seg is None else packed_attention_mask(seg.to(x.device), kv_cache.offset)
        else:
            mask = packed_segments(self.cfg, batch.get("segment_ids"), x, self.training, batch.get("cu_seqlens"),
                                   batch.get("max_seqlen")) or self.attention_mask(batch)
        rotary = None
        if self.cfg.position_embedding_type == "rope":
            if pos is None:  # [s, b, h] hidden states of an unpacked batch (s/tp of them under SP)
                s = x.shape[0] * (self.ps.tp_size if self.sequence_parallel else 1)
                pos = torch.arange(s, device=x.device).unsqueeze(0).expand(x.shape[1], s)
            rotary = rotary_cos_sin(self.cfg, pos.to(x.device), torch.float32)
        if kv_cache is not None:
            x = self.decoder(x, mask, recompute=self.recompute, rotary=rotary, kv_cache=kv_cache)
        else:
            x = self.decoder(x, mask, recompute=self.recompute, rotary=rotary)
        if not self.post_process:
            return [x]
        x = self.final_layernorm(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.ps.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.ps.tp_group)
        logits = F.linear(x, self.output_weight())  # [s, b, v/tp]
        labels = batch["labels"].transpose(0, 1)
        losses = vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, self.cfg.vocab_size)
        return [losses.transpose(0, 1)]  # [b, s]


def gpt_activation_shapes(cfg: ModelConfig, microbatch_shapes, tp_size: int = 1):
    """(mb, stage) -> shapes of the stage's output: [s, b, h] for every GPT stage boundary
    ([s / tp, b, h] with sequence parallelism: stages exchange their sequence chunks)."""
    tp = tp_size if cfg.sequence_parallel else 1

    def shapes(mb, stage):
        b, s = microbatch_shapes[mb][0]
        if s % tp:
            raise ValueError(f"--sequence-parallel: micro-batch {mb} has {s} tokens per sample, not a multiple of "
                             f"--tensor-model-parallel-size {tp}")
        return ((s // tp, b, cfg.hidden_size),)
    return shapes


def num_model_chunks(cfg) -> int:
    p = cfg.parallel
    if p.pipeline_schedule in V_SCHEDULES:
        return 2
    if p.num_layers_per_virtual_pipeline_stage is None:
        return 1
    return cfg.model.num_layers // p.pipeline_model_parallel_size // p.num_layers_per_virtual_pipeline_stage


def build_gpt_stages(cfg, ps: ParallelState) -> dict:
    """The GPT stages this pipeline rank owns: {stage id: GPTStage}. Stage k*PP + r lives on
    pipeline rank r (Megatron's interleaved placement; k = 0 without virtual stages); with
    --pipeline-schedule zb-v or dualpipev rank r owns stages r and 2PP-1-r (a V)."""
    from megatron.models.stage_split import stage_layer_split
    pp = ps.pp_size
    chunks = num_model_chunks(cfg)
    num_stages = pp * chunks
    split = stage_layer_split(cfg.model.num_layers, num_stages, cfg.parallel.pipeline_stage_layers)
    starts = [sum(split[:i]) for i in range(num_stages)]
    stages = {}
    v_shape = cfg.parallel.pipeline_schedule in V_SCHEDULES
    for k in range(chunks):
        sid = (num_stages - 1 - ps.pp_rank if k else ps.pp_rank) if v_shape else k * pp + ps.pp_rank
        stages[sid] = GPTStage(cfg.model, ps, layer_start=starts[sid], layer_end=starts[sid] + split[sid],
                               pre_process=sid == 0, post_process=sid == num_stages - 1,
                               seed=cfg.training.seed, recompute_method=cfg.training.recompute_method,
                               recompute_num_layers=cfg.training.recompute_num_layers)
        stages[sid].cp_comm_type = cfg.parallel.cp_comm_type
        if cfg.training.recompute_layers is not None:  # --aceso-config: per-layer recompute
            modes = cfg.training.recompute_layers[starts[sid]:starts[sid] + split[sid]]
            for mode, layer in zip(modes, stages[sid].decoder.layers):
                try:  # fail at build time, not at the first forward
                    unit_flags(layer.op_units(), recompute_set(mode))
                except ValueError as e:
                    raise ValueError(f"--aceso-config: layer {layer.layer_number}: {e}") from None
            stages[sid].decoder.layer_recompute = modes
    last = stages.get(num_stages - 1)
    if num_stages > 1 and 0 in stages and last is not None and hasattr(last, "output_layer") \
            and getattr(last.output_layer.weight, "shared_embedding", False):
        # The V puts the first and the last stage on one rank: one tied weight, not two copies
        # to keep equal. The last stage borrows it without registering it (no parameter twice).
        del last.output_layer
        object.__setattr__(last, "_tied_embedding_stage", stages[0])
    return stages


def tied_embedding_params(stages: dict, num_stages: int) -> list:
    """Word-embedding copies that must stay equal across the first and last stage (PP > 1)."""
    out = []
    if 0 in stages and (num_stages - 1) not in stages:
        out.append(stages[0].embedding.word_embeddings.weight)
    last = stages.get(num_stages - 1)
    if last is not None and 0 not in stages \
            and getattr(getattr(last, "output_layer", None), "weight", None) is not None \
            and getattr(last.output_layer.weight, "shared_embedding", False):
        out.append(last.output_layer.weight)
    return out
