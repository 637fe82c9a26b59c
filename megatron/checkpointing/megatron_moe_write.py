"""Writing an MoE GPT as Megatron-Core writes it with `--ckpt-format torch` (core_v0.9.0, local
layer spec, SequentialMLP experts): flat Megatron-Core names, one file per (TP, PP, EP) rank in
`mp_rank_TT[_PPP][_EEE]` (`_EEE` iff EP > 1), each EP file holding its experts under local
indices and repeating the dense weights, as Megatron's `save_checkpoint` leaves them. Megatron's
`load_checkpoint` reads the result into `GPTModel` (strict), which
tests/checkpointing/test_checkpoint_megatron_moe_write.py runs. The legacy model classes
(`megatron_write.to_legacy_model`) have no top-k MoE, hence Megatron-Core's names here.

Only what core_v0.9.0's MoE computes is written: every layer an MoE layer, softmax top-k router
(pre- or post-softmax), dropless or a capacity factor, no shared expert, no sigmoid / expert bias,
experts as wide as --ffn-hidden-size, TP 1 (Megatron shards experts over TP, not written yet).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict

import torch

from megatron.checkpointing.megatron_base import MegatronCheckpointError

# our layer names -> Megatron-Core's (the local spec's modules)
_LAYER = [("input_layernorm.", "input_layernorm."), ("self_attention.query_key_value.", "self_attention.linear_qkv."),
          ("self_attention.dense.", "self_attention.linear_proj."), ("post_attention_layernorm.", "pre_mlp_layernorm."),
          ("mlp.router.", "mlp.router.")]
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")


def check_writable(model: dict, tp: int) -> dict:
    """Megatron's MoE args for `model` (our model dict), or a one-line refusal."""
    moe = model["moe"]
    bad = []
    if tp != 1:
        bad.append(f"TP {tp} (Megatron shards experts over TP; write TP 1)")
    if moe.get("layer_freq", 1) != 1:
        bad.append("--moe-layer-freq other than 1 (core_v0.9.0 makes every layer an MoE layer)")
    for k, what in (("shared_expert_intermediate_size", "a shared expert"),
                    ("router_enable_expert_bias", "--moe-router-enable-expert-bias"),
                    ("router_topk_scaling_factor", "--moe-router-topk-scaling-factor")):
        if moe.get(k):
            bad.append(what)
    if moe.get("router_score_function", "softmax") != "softmax":
        bad.append("--moe-router-score-function sigmoid")
    if moe.get("ffn_hidden_size") not in (None, model.get("ffn_hidden_size")):
        bad.append("--moe-ffn-hidden-size other than --ffn-hidden-size")
    if bad:
        raise MegatronCheckpointError("Megatron-LM core_v0.9.0's MoE cannot hold " + "; ".join(bad) +
                                      ": write this checkpoint with --ckpt-format torch (this project's format)")
    return dict(num_experts=moe["num_experts"], moe_router_topk=moe.get("router_topk", 2),
                moe_router_pre_softmax=bool(moe.get("router_pre_softmax")),
                moe_router_load_balancing_type=moe.get("router_load_balancing_type", "aux_loss"),
                moe_aux_loss_coeff=moe.get("aux_loss_coeff", 0.0), moe_z_loss_coeff=moe.get("z_loss_coeff"),
                moe_expert_capacity_factor=moe.get("expert_capacity_factor"),
                moe_token_drop_policy=moe.get("token_drop_policy", "probs"),
                moe_pad_expert_input_to_capacity=bool(moe.get("pad_expert_input_to_capacity")),
                moe_token_dispatcher_type=moe.get("token_dispatcher_type", "allgather"), moe_grouped_gemm=False,
                moe_input_jitter_eps=None, moe_per_layer_logging=False, moe_layer_recompute=False,
                moe_extended_tp=False, moe_use_upcycling=False)


def to_core_stage(stage: Dict[str, torch.Tensor], ep_rank: int, ep: int, num_experts: int, tied: bool,
                  pre: bool, post: bool) -> dict:
    """One stage's tensors in our names (stage-local layers) -> Megatron-Core's flat model dict of
    EP rank `ep_rank` (its experts under local indices), with the `_extra_state` entries its
    linears save (None: the local spec's linears keep none)."""
    local = num_experts // ep
    out: dict = {}
    layers = set()
    for k, v in stage.items():
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", k)
        if m:
            i, rest = m.group(1), m.group(2)
            layers.add(i)
            e = re.match(r"^mlp\.experts\.(weight|bias)([12])$", rest)
            if e:
                for j in range(local):
                    name = f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{e.group(2)}"
                    out[f"{name}.{e.group(1)}"] = v[ep_rank * local + j].contiguous().clone()
                    out[f"{name}._extra_state"] = None
                continue
            for a, b in _LAYER:
                if rest.startswith(a):
                    out[f"decoder.layers.{i}.{b}{rest[len(a):]}"] = v
                    break
            else:
                raise MegatronCheckpointError(f"no Megatron-Core MoE name for {k}")
        elif k == "embedding.position_embeddings":
            out["embedding.position_embeddings.weight"] = v
        elif k == "embedding.word_embeddings.weight":
            out[k] = v
        elif k.startswith("final_layernorm."):
            out["decoder." + k] = v
        elif k == "output_layer.weight":
            if not tied or not pre:  # a tied head is the embedding's; a later stage keeps its copy
                out[k] = v
        else:
            raise MegatronCheckpointError(f"no Megatron-Core MoE name for {k}")
    for i in layers:
        for lin in _LINEARS:
            out[f"decoder.layers.{i}.{lin}._extra_state"] = None
    if post:
        out["output_layer._extra_state"] = None
    return out


def write_full(out: str, model: dict, full: Dict[str, torch.Tensor], meta: dict, tp: int, pp: int, ep: int,
               args, atomic_write, release: bool) -> str:
    """`megatron_write.write_full` for an MoE GPT (its `args` already built): the files of every
    (PP, EP) rank, the manifest and the tracker. Returns the iteration folder."""
    from megatron.checkpointing.megatron_base import _pad_rows, megatron_rng_state, megatron_scheduler
    from megatron.checkpointing.megatron_legacy import TRACKER
    moe_args = check_writable(model, tp)
    if moe_args["num_experts"] % ep:
        raise MegatronCheckpointError(f"--target-expert-parallel-size {ep} does not divide the "
                                      f"{moe_args['num_experts']} experts")
    vars(args).update(moe_args, expert_model_parallel_size=ep, transformer_impl="local", use_legacy_models=False)
    L, E = model["num_layers"], moe_args["num_experts"]
    if L % pp:
        raise MegatronCheckpointError(f"PP {pp} does not divide the {L} layers")
    per, padded = L // pp, args.padded_vocab_size
    tied = not model.get("untie_embeddings_and_output_weights")
    iteration = meta.get("iteration", 0)
    it_dir = os.path.join(out, "release" if release else f"iter_{iteration:07d}")
    files = {}
    for p in range(pp):
        stage = {}
        for name, t in full.items():
            m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
            if m:
                i = int(m.group(1))
                if p * per <= i < (p + 1) * per:
                    stage[f"decoder.layers.{i - p * per}.{m.group(2)}"] = t
            elif name.startswith("embedding.") and p == 0 or name.startswith("final_layernorm.") and p == pp - 1:
                stage[name] = t
            elif name == "output_layer.weight" and p == pp - 1 and not tied:
                stage[name] = _pad_rows(t, padded)
        stage["embedding.word_embeddings.weight"] = _pad_rows(full["embedding.word_embeddings.weight"], padded)
        if p != 0:  # only the first stage holds the embedding; a tied last stage keeps a copy as its head
            w = stage.pop("embedding.word_embeddings.weight")
            if tied and p == pp - 1:
                stage["output_layer.weight"] = w
        for e in range(ep):
            state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "rng_state": megatron_rng_state(),
                     "model": to_core_stage(stage, e, ep, E, tied, p == 0, p == pp - 1)}
            sched = megatron_scheduler(meta.get("opt_param_scheduler"))
            if sched is not None:
                state["opt_param_scheduler"] = sched
            sub = "mp_rank_00" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
            path = os.path.join(it_dir, sub, "model_optim_rng.pt")
            digest = atomic_write(path, lambda f: torch.save(state, f))
            files[os.path.join(sub, "model_optim_rng.pt")] = {"sha256": digest, "bytes": os.path.getsize(path)}
    body = json.dumps({"iteration": iteration, "checkpoint_version": 3.0, "format": "megatron-core-torch-moe",
                       "files": files}, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(it_dir, "manifest.json"), lambda f: f.write(body))
    tracker = "release" if release else str(iteration)
    atomic_write(os.path.join(out, TRACKER), lambda f: f.write(tracker.encode()))
    return it_dir
