"""T5 (encoder-decoder), built one pipeline stage at a time, Megatron style.

With PP = p and split rank r (`--pipeline-model-parallel-split-rank`), pipeline ranks [0, r)
hold the encoder layers and [r, p) the decoder layers, each split evenly. At PP = 1 one stage
runs encoder then decoder. Stage ids are pipeline ranks (no virtual stages).

Stage boundaries carry [s, b, h] activations: encoder stages send ((s_enc, b, h),); decoder
stages send ((s_dec, b, h), (s_enc, b, h)) - the encoder output travels with the decoder
hidden states because every decoder layer cross-attends to it (its gradient flows back the
same way). The first decoder stage receives only the encoder output.

The word embedding (vocab-parallel) is shared by encoder and decoder and tied to the LM head.
Stage 0, the first decoder stage and the last stage each hold a copy that starts identical
(same init key) and whose gradients are summed over {0, r, last} (`t5_parallel_state`); with
--untie-embeddings-and-output-weights the last stage has its own LM-head table and the sum is
over {0, r}. With
learned absolute positions the position table is shared the same way over {0, r}.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.core import ConfigError, ModelConfig
from megatron.core.parallel_state import ParallelState, global_rank
from megatron.core.tensor_parallel import (VocabParallelEmbedding, copy_to_tensor_model_parallel_region,
                                           mark_tensor_parallel, vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.layers import init_full
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.models.gpt import WORD_EMBEDDING_KEY, GPTEmbedding
from megatron.models.transformer import TransformerBlock, TransformerLayer, build_norm

POSITION_EMBEDDING_KEY = "embedding.position_embeddings"


# -- relative position bias ------------------------------------------------------------------
def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucketing of (key - query) offsets: exact buckets for small distances, log-spaced
    up to max_distance, one bucket beyond. Bidirectional (encoder) spends half the buckets on
    each direction; causal (decoder) maps every future offset to bucket 0."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # clamp(min=1) only keeps log() finite; those entries take the exact branch anyway.
    large = max_exact + (torch.log(distance.clamp(min=1).float() / max_exact)
                         / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """Per-layer learned bias per (bucket, head), sharded by heads across TP: the full
    [buckets, heads] table is drawn from the layer's key, then this rank's heads are sliced."""

    def __init__(self, cfg: ModelConfig, tp_group, *, bidirectional: bool, seed: int, key: str):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        heads = cfg.num_attention_heads // tp
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        full = init_full((self.num_buckets, cfg.num_attention_heads), cfg.init_method_std, seed, key + ".weight")
        self.weight = nn.Parameter(full[:, r * heads:(r + 1) * heads].clone())
        mark_tensor_parallel(self.weight, 1)

    def forward(self, sq: int, sk: int) -> torch.Tensor:
        """Additive bias [1, heads/tp, sq, sk]."""
        dev = self.weight.device
        rel = torch.arange(sk, device=dev)[None, :] - torch.arange(sq, device=dev)[:, None]
        buckets = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)


# -- masks -----------------------------------------------------------------------------------
def _valid(mask: torch.Tensor) -> torch.Tensor:
    """Per-token validity [b, s] from a 1-D-per-sample mask [b, s] or a 2-D one [b, s, s]
    (a real token may attend to itself, a padding token to nothing)."""
    return mask.bool() if mask.dim() == 2 else mask.bool().diagonal(dim1=-2, dim2=-1)


def _attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """[b, sq, sk] bool -> [b, 1, sq, sk]. A padding query's row is all False; torch < 2.5 and
    some fused kernels return NaN for such a row, which then leaks through 0 * NaN into real
    tokens of later layers. Such rows may attend everywhere instead (like Megatron's -10000
    fill): their outputs never reach a real token or a loss token."""
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask.unsqueeze(1)


def t5_masks(batch: dict):
    """(encoder self, decoder self, cross) attention masks [b, 1, sq, sk] from Megatron's
    enc_mask / dec_mask (and enc_dec_mask when the data has it). The decoder mask is always
    intersected with the causal triangle, whatever the data says."""
    enc, dec = batch["enc_mask"].bool(), batch["dec_mask"].bool()
    enc_valid, dec_valid = _valid(enc), _valid(dec)
    if enc.dim() == 2:
        enc = enc_valid[:, None, :] & enc_valid[:, :, None]
    if dec.dim() == 2:
        dec = dec_valid[:, None, :] & dec_valid[:, :, None]
    sd = dec.shape[-1]
    dec = dec & torch.ones(sd, sd, dtype=torch.bool, device=dec.device).tril()
    cross = batch.get("enc_dec_mask")
    cross = cross.bool() if cross is not None else dec_valid[:, :, None] & enc_valid[:, None, :]
    return _attention_mask(enc), _attention_mask(dec), _attention_mask(cross)


# -- stages ----------------------------------------------------------------------------------
def t5_split_rank(cfg) -> int:
    """Validated split rank (first decoder pipeline rank); 0 when PP = 1 (one stage)."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage is not supported for T5: its encoder and "
                          "decoder are split by --pipeline-model-parallel-split-rank instead")
    r = p.pipeline_model_parallel_split_rank
    if p.pipeline_stage_layers is not None and pp > 1:
        derived = _explicit_split_rank(cfg)
        if r is not None and r != derived:
            raise ConfigError(f"--pipeline-model-parallel-split-rank {r} disagrees with --pipeline-stage-layers "
                              f"{','.join(map(str, p.pipeline_stage_layers))}, whose first decoder layer is on "
                              f"pipeline rank {derived}; drop the split rank")
        return derived
    if pp == 1:
        if r not in (None, 0):
            raise ConfigError(f"--pipeline-model-parallel-split-rank {r} needs --pipeline-model-parallel-size > 1")
        return 0
    if r is None:
        raise ConfigError(f"T5 with --pipeline-model-parallel-size {pp} needs --pipeline-model-parallel-split-rank "
                          "(the first pipeline rank of the decoder)")
    if not 0 < r < pp:
        raise ConfigError(f"--pipeline-model-parallel-split-rank must be in (0, {pp}) for "
                          f"--pipeline-model-parallel-size {pp}, got {r}")
    return r


def _explicit_ranges(cfg) -> list:
    """--pipeline-stage-layers for T5: per stage a count of the layer sequence encoder 0..E-1,
    then decoder 0..D-1 (so a stage may end the encoder and start the decoder, as Aceso's
    configs cut it). Per stage ((enc_start, enc_end), (dec_start, dec_end)); empty = (0, 0)."""
    E = cfg.model.encoder_num_layers
    out, start = [], 0
    for n in cfg.parallel.pipeline_stage_layers:
        end = start + n
        enc = (start, min(end, E)) if start < E else (0, 0)
        dec = (max(start, E) - E, end - E) if end > E else (0, 0)
        out.append((enc, dec))
        start = end
    return out


def _explicit_split_rank(cfg) -> int:
    """First pipeline rank holding a decoder layer (it embeds the decoder's tokens)."""
    return next(k for k, (_, dec) in enumerate(_explicit_ranges(cfg)) if dec[1] > dec[0])


def t5_stage_layers(cfg) -> list:
    """Per pipeline rank: ((enc_start, enc_end), (dec_start, dec_end)) layer ranges."""
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    r = t5_split_rank(cfg)
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < m.decoder_seq_length:
        raise ConfigError(f"--max-position-embeddings ({m.max_position_embeddings}) must be >= "
                          f"--decoder-seq-length ({m.decoder_seq_length}) with learned absolute positions")
    if cfg.parallel.pipeline_stage_layers is not None and pp > 1:
        return _explicit_ranges(cfg)
    if pp == 1:
        return [((0, m.encoder_num_layers), (0, m.decoder_num_layers))]
    if m.encoder_num_layers % r:
        raise ConfigError(f"--encoder-num-layers ({m.encoder_num_layers}) is not divisible by the "
                          f"{r} encoder pipeline ranks (--pipeline-model-parallel-split-rank {r})")
    nd = pp - r
    if m.decoder_num_layers % nd:
        raise ConfigError(f"--decoder-num-layers ({m.decoder_num_layers}) is not divisible by the {nd} decoder "
                          f"pipeline ranks (--pipeline-model-parallel-size {pp} - split rank {r})")
    ne, nl = m.encoder_num_layers // r, m.decoder_num_layers // nd
    return [((i * ne, (i + 1) * ne), (0, 0)) for i in range(r)] + \
           [((0, 0), (i * nl, (i + 1) * nl)) for i in range(nd)]


def _layers(cfg: ModelConfig, ps: ParallelState, lo: int, hi: int, *, decoder: bool, seed: int, total: int):
    prefix = "decoder" if decoder else "encoder"
    out = []
    for i in range(lo, hi):
        key = f"{prefix}.layers.{i}"
        bias = None
        if cfg.position_embedding_type == "relative":
            bias = RelativePositionBias(cfg, ps.tp_group, bidirectional=not decoder, seed=seed,
                                        key=key + ".relative_attention_bias")
        out.append(TransformerLayer(cfg, ps.tp_group, layer_number=i, num_layers_total=total, seed=seed, key=key,
                                    causal=decoder, decoder=decoder, relative_bias=bias))
    return out


class T5Stage(nn.Module):
    """One pipeline stage of T5: `forward(batch, inputs) -> outputs` (see module docstring);
    the last stage returns the per-token losses [b, s_dec] (fp32)."""

    # Only the stage's own new activation may be freed after sending: a decoder stage's second
    # output is the encoder output it received, passed through unchanged.
    deallocatable_outputs = (0,)

    def __init__(self, cfg: ModelConfig, ps: ParallelState, *, encoder_layers: tuple, decoder_layers: tuple,
                 pre_process: bool, pre_process_decoder: bool, post_process: bool, encoder_end: bool, seed: int,
                 recompute_method: Optional[str] = None, recompute_num_layers: Optional[int] = None):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.pre_process_decoder = pre_process, pre_process_decoder
        self.post_process, self.encoder_end = post_process, encoder_end
        self.encoder_layers, self.decoder_layers = encoder_layers, decoder_layers
        self.has_encoder = encoder_layers[1] > encoder_layers[0] or encoder_end
        self.has_decoder = decoder_layers[1] > decoder_layers[0]
        self.padded_vocab = cfg.padded_vocab_size(ps.tp_size)
        self.recompute = "none"
        if pre_process or pre_process_decoder:
            self.embedding = GPTEmbedding(cfg, ps, self.padded_vocab, seed)
            if cfg.position_embedding_type != "learned_absolute":
                del self.embedding.position_embeddings
                self.embedding.position_embeddings = None
            if not pre_process:  # the first decoder stage's copy of the tied tables
                for p in self.embedding.parameters():
                    p.shared_embedding = True
        rec = dict(recompute_method=recompute_method, recompute_num_layers=recompute_num_layers)
        self.encoder = TransformerBlock(_layers(cfg, ps, *encoder_layers, decoder=False, seed=seed,
                                                total=cfg.encoder_num_layers), **rec)
        if encoder_end:
            self.encoder_final_layernorm = build_norm(cfg)
        self.decoder = TransformerBlock(_layers(cfg, ps, *decoder_layers, decoder=True, seed=seed,
                                                total=cfg.decoder_num_layers), **rec)
        if post_process:
            self.decoder_final_layernorm = build_norm(cfg)
            if cfg.untie_embeddings_and_output_weights:  # its own LM-head table (T5 v1.1 / Flan-T5)
                self.output_layer = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, ps.tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key="output_layer", real_vocab_size=cfg.vocab_size)
            elif not pre_process_decoder:
                # Same key as the embedding -> identical initial values (kept equal by the grad sum).
                self.output_layer = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, ps.tp_group,
                                                           init_std=cfg.init_method_std, seed=seed,
                                                           key=WORD_EMBEDDING_KEY, real_vocab_size=cfg.vocab_size)
                self.output_layer.weight.shared_embedding = True
            # Megatron's T5 LM head adds a vocab-parallel bias to the tied projection.
            self.lm_head_bias = nn.Parameter(torch.zeros(self.padded_vocab // ps.tp_size))
            mark_tensor_parallel(self.lm_head_bias, 0)

    def _embed(self, tokens, pos=None):
        """`pos`: position ids (packed rows restart them per pair); default 0..s-1."""
        if self.embedding.position_embeddings is not None:
            if pos is None:
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            return self.embedding(tokens, pos)
        x = self.embedding.word_embeddings(tokens).transpose(0, 1).contiguous()
        d = self.embedding.dropout
        return F.dropout(x, d, self.training) if d > 0 else x

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, batch: dict, inputs: list) -> list:
        enc_mask, dec_mask, cross_mask = t5_masks(batch)
        enc_out = None
        if self.has_encoder:
            x = self._embed(batch["text_enc"], batch.get("enc_position_ids")) if self.pre_process else inputs[0]
            x = self.encoder(x, enc_mask, recompute=self.recompute)
            if self.encoder_end:
                x = self.encoder_final_layernorm(x)
            if not self.has_decoder:
                return [x]
            enc_out = x
        if self.pre_process_decoder:
            if enc_out is None:
                (enc_out,) = inputs
            y = self._embed(batch["text_dec"], batch.get("dec_position_ids"))
        else:
            y, enc_out = inputs
        y = self.decoder(y, dec_mask, enc_out, cross_mask, recompute=self.recompute)
        if not self.post_process:
            return [y, enc_out]
        y = self.decoder_final_layernorm(y)
        y = copy_to_tensor_model_parallel_region(y, self.ps.tp_group)
        logits = F.linear(y, self.output_weight(), self.lm_head_bias)  # [s, b, v/tp]
        labels = batch["labels"].transpose(0, 1)
        losses = vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, self.cfg.vocab_size)
        return [losses.transpose(0, 1)]  # [b, s_dec]


def build_t5_stages(cfg, ps: ParallelState) -> dict:
    """{pipeline rank: T5Stage} for this rank."""
    layout = t5_stage_layers(cfg)
    r = t5_split_rank(cfg)
    pp, k = ps.pp_size, ps.pp_rank
    (e0, e1), (d0, d1) = layout[k]
    m = cfg.model
    stage = T5Stage(m, ps, encoder_layers=(e0, e1), decoder_layers=(d0, d1), pre_process=k == 0,
                    pre_process_decoder=k == r, post_process=k == pp - 1,
                    encoder_end=e1 == m.encoder_num_layers and e1 > e0, seed=cfg.training.seed,
                    recompute_method=cfg.training.recompute_method,
                    recompute_num_layers=cfg.training.recompute_num_layers)
    if cfg.training.recompute_layers is not None:  # --aceso-config: per layer, encoder then decoder
        modes, E = cfg.training.recompute_layers, m.encoder_num_layers
        stage.encoder.layer_recompute = modes[e0:e1]
        stage.decoder.layer_recompute = modes[E + d0:E + d1]
    return {k: stage}


def t5_tied_params(stages: dict) -> tuple:
    """(word-embedding copies, position-table copies) this rank contributes to the tied
    gradient sums; empty at PP = 1 where one stage holds the single copy."""
    (stage,) = stages.values()
    if stage.ps.pp_size == 1:
        return [], []
    if hasattr(stage, "embedding"):
        pos = stage.embedding.position_embeddings
        return [stage.embedding.word_embeddings.weight], ([pos] if pos is not None else [])
    if hasattr(stage, "output_layer") and not stage.cfg.untie_embeddings_and_output_weights:
        return [stage.output_layer.weight], []
    return [], []


def t5_parallel_state(cfg, ps: ParallelState):
    """(ps with embedding_group = {0, split, last} of this rank's pipeline, position group
    {0, split} or None). Collective: every rank creates every group, in the same order."""
    pp = ps.pp_size
    if pp == 1:
        return ps, None
    r = t5_split_rank(cfg)
    if ps.stage_layouts:
        return _t5_resharded_groups(cfg, ps, r)
    dp, tp = ps.dp_size, ps.tp_size
    # An untied LM head is the last stage's own: only the two input embeddings are summed.
    emb_ranks = sorted({0, r} if cfg.model.untie_embeddings_and_output_weights else {0, r, pp - 1})
    new = ps
    if emb_ranks != [0, pp - 1]:  # otherwise parallel_state's {first, last} group is this one
        new = dataclasses.replace(ps, embedding_group=None, embedding_global_ranks=[])
        for d in range(dp):
            for t in range(tp):
                ranks = [global_rank(t, d, p, tp, dp) for p in emb_ranks]
                g = dist.new_group(ranks, timeout=ps.timeout)
                if ps.rank in ranks:
                    new = dataclasses.replace(ps, embedding_group=g, embedding_global_ranks=ranks)
    pos_group = None
    if cfg.model.position_embedding_type == "learned_absolute":
        for d in range(dp):
            for t in range(tp):
                ranks = [global_rank(t, d, p, tp, dp) for p in (0, r)]
                g = dist.new_group(ranks, timeout=ps.timeout)
                if ps.rank in ranks:
                    pos_group = g
    return new, pos_group


def _t5_resharded_groups(cfg, ps: ParallelState, r: int):
    """`t5_parallel_state` for stages with their own TP/DP sizes: one group holding every rank of
    the tied stages ({0, split, last}; {0, split} for positions). Their shards differ, so the
    sums run over whole-table buffers (the trainer's resharded sync), across all DP replicas."""
    from megatron.core.parallel_state import stage_rank_offsets
    offsets, layouts = stage_rank_offsets(ps.stage_layouts), ps.stage_layouts
    pp = len(layouts)

    def group(stages):
        ranks = [offsets[s] + i for s in sorted(set(stages)) for i in range(layouts[s][0] * layouts[s][1])]
        g = dist.new_group(ranks, timeout=ps.timeout)
        return (g, ranks) if ps.rank in ranks else (None, [])

    word = (0, r) if cfg.model.untie_embeddings_and_output_weights else (0, r, pp - 1)
    g, ranks = group(word)
    new = dataclasses.replace(ps, embedding_group=g, embedding_global_ranks=ranks)
    pos_group = None
    if cfg.model.position_embedding_type == "learned_absolute":
        pos_group = group((0, r))[0]
    return new, pos_group


# -- shapes and FLOPs ------------------------------------------------------------------------
def t5_activation_shapes(cfg, microbatch_shapes):
    """(mb, stage) -> shapes of the stage's outputs (see module docstring)."""
    h = cfg.model.hidden_size
    r = t5_split_rank(cfg)

    def shapes(mb, stage):
        (b, s_enc), (_, s_dec) = microbatch_shapes[mb]
        if stage < r:
            return ((s_enc, b, h),)
        return ((s_dec, b, h), (s_enc, b, h))
    return shapes


def t5_microbatch(samples) -> dict:
    """Stack dataset samples (Megatron's keys) into a micro-batch; loss_mask as float."""
    out = {}
    keys = ["text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"]
    if all("enc_dec_mask" in s for s in samples):
        keys.append("enc_dec_mask")
    for k in keys:
        try:
            out[k] = torch.from_numpy(np.stack([np.asarray(s[k]) for s in samples]))
        except KeyError:
            raise KeyError(f"T5 sample lacks {k!r}; a T5 dataset yields text_enc, text_dec, labels, loss_mask, "
                           "enc_mask and dec_mask") from None
    for k in ("text_enc", "text_dec", "labels"):
        out[k] = out[k].long()
    for k in ("enc_mask", "dec_mask", "enc_dec_mask"):
        if k in out:
            out[k] = out[k].bool()
    out["loss_mask"] = out["loss_mask"].float()
    return out


def t5_microbatch_shapes(mb: dict) -> tuple:
    """LoadInput shapes of a T5 micro-batch: ((b, s_enc), (b, s_dec))."""
    return (tuple(mb["text_enc"].shape), tuple(mb["text_dec"].shape))


def t5_flops_per_sample(m: ModelConfig, padded_vocab: int) -> float:
    """Model FLOPs (forward + backward = 3x forward, no recomputation) of one sample.

    Per token and layer the forward does 2 multiply-add FLOPs per weight: encoder layers as
    GPT's (QKV 3hp, attention 2 s p, projection ph, MLP 2hf); decoder layers add
    cross-attention (query hp and projection ph per decoder token, key/value 2hp per encoder
    token, attention 2 s_enc p per decoder token); the LM head is hV per decoder token."""
    h, p, f = m.hidden_size, m.projection_size, m.ffn_hidden_size
    se, sd = m.encoder_seq_length, m.decoder_seq_length
    enc = se * (2 * (3 * h * p + 2 * se * p + p * h + 2 * h * f))
    dec_self = sd * (2 * (3 * h * p + 2 * sd * p + p * h + 2 * h * f))
    cross = sd * 2 * (h * p + 2 * se * p + p * h) + se * 2 * (2 * h * p)
    head = sd * 2 * h * padded_vocab
    return 3.0 * (m.encoder_num_layers * enc + m.decoder_num_layers * (dec_self + cross) + head)
