"""Aceso's JSON configuration format, read and written.

Fields (one entry per stage in the lists, one per op of that stage in the nested lists):

- ``model_name`` (``gpt``/``t5``), ``model_size`` (DB spelling, e.g. ``1_3B``), ``num_layers``
  (per layer kind: GPT one number, T5 ``[encoder, decoder]``), ``hidden_size``, ``seq_length``;
- ``global_batch_size``, ``micro_batch_size`` (samples per micro-batch of the whole pipeline;
  a stage with DP size d gives each DP rank ``micro_batch_size / d``), ``num_stages``;
- ``num_gpus``: GPUs of each stage (= TP x DP; stages take contiguous rank ranges in order);
- ``checkpoint_activations``: whether the stage recomputes anything;
- ``resharding_stages``: whether TP/DP changes between ops inside the stage;
- ``num_ops_in_each_stage``: op counts; stage s owns ops ``[sum(previous), sum(previous)+n)``
  of the flat op list (embedding, the per-layer ops once per layer, final norm, post-process);
- ``model_parallel_size_of_each_op`` / ``data_parallel_size_of_each_op``: TP / DP per op;
- ``recompute_ops``: 0/1 per op; ``algo_of_each_op``: 0 Megatron column/row split, 1 swapped.

This implementation prices one (TP, DP, algo) per stage; a file whose ops change TP, DP or
algo inside a stage is rejected with a message saying so.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

from megatron.aceso.model import ModelSpec, Plan, Stage
from megatron.config.json_keys import refuse_unknown_keys


def plan_to_dict(plan: Plan, spec: ModelSpec) -> Dict[str, Any]:
    stages = plan.stages
    return {
        "model_name": spec.family,
        "model_size": spec.size,
        "num_layers": spec.layers[0] if len(spec.layers) == 1 else list(spec.layers),
        "hidden_size": spec.hidden,
        "seq_length": spec.seq_length,
        "global_batch_size": plan.global_batch,
        "micro_batch_size": plan.micro_batch,
        "num_stages": len(stages),
        "num_gpus": [s.gpus for s in stages],
        "checkpoint_activations": [bool(any(s.flags())) for s in stages],
        "resharding_stages": [False for _ in stages],
        "num_ops_in_each_stage": [s.end - s.start for s in stages],
        "model_parallel_size_of_each_op": [[s.tp] * (s.end - s.start) for s in stages],
        "data_parallel_size_of_each_op": [[s.dp] * (s.end - s.start) for s in stages],
        "recompute_ops": [list(s.flags()) for s in stages],
        "algo_of_each_op": [[s.algo] * (s.end - s.start) for s in stages],
    }


_PLAN_FIELDS = {"model_name": str, "num_stages": int, "micro_batch_size": int, "global_batch_size": int,
                "num_gpus": list, "num_ops_in_each_stage": list, "model_parallel_size_of_each_op": list,
                "data_parallel_size_of_each_op": list, "recompute_ops": list}


# Every key a config may hold: what plan_to_dict writes, and the model description fields of
# Aceso's own files (read by Aceso's runtime, not needed here). Anything else is a typo.
_KNOWN_FIELDS = ("model_name", "model_size", "num_layers", "hidden_size", "seq_length", "global_batch_size",
                 "micro_batch_size", "num_stages", "num_gpus", "checkpoint_activations", "resharding_stages",
                 "num_ops_in_each_stage", "model_parallel_size_of_each_op", "data_parallel_size_of_each_op",
                 "recompute_ops", "algo_of_each_op", "num_attention_heads", "max_position_embeddings",
                 "vocab_size", "ffn_hidden_size", "kv_channels", "encoder_seq_length", "decoder_seq_length",
                 "flex_recompute_activations")


_LAYOUT_FIELDS = ("num_stages", "num_ops_in_each_stage", "model_parallel_size_of_each_op",
                  "data_parallel_size_of_each_op")


def check_plan_fields(d, required=tuple(_PLAN_FIELDS)) -> None:
    """Field presence and types first, so a hostile or hand-edited file gets one line, not a traceback."""
    if not isinstance(d, dict):
        raise ValueError(f"aceso config: the top level must be a JSON object, got {type(d).__name__}")
    refuse_unknown_keys(d, _KNOWN_FIELDS, "aceso config")
    for k, t in _PLAN_FIELDS.items():
        if k not in d and k not in required:
            continue
        if k not in d:
            raise ValueError(f"aceso config: missing field '{k}'")
        if not isinstance(d[k], t) or isinstance(d[k], bool):
            raise ValueError(f"aceso config: field '{k}' is {type(d[k]).__name__}, expected {t.__name__}")
    for k in ("num_stages", "micro_batch_size", "global_batch_size"):
        if k in d and d[k] < 1:
            raise ValueError(f"aceso config: field '{k}' is {d[k]}, must be >= 1")
    for k in ("num_gpus", "num_ops_in_each_stage"):
        if k in d and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in d[k]):
            raise ValueError(f"aceso config: field '{k}' must hold positive integers")
    for k in ("model_parallel_size_of_each_op", "data_parallel_size_of_each_op", "recompute_ops",
              "algo_of_each_op"):
        v = d.get(k) or []
        if not all(isinstance(st, list) and all(isinstance(x, int) and x >= 0 for x in st) for st in v):
            raise ValueError(f"aceso config: field '{k}' must be one list of non-negative integers per stage")
    if any(x < 1 for k in ("model_parallel_size_of_each_op", "data_parallel_size_of_each_op") for st in d[k]
           for x in st):
        raise ValueError("aceso config: TP and DP sizes must be >= 1")
    for k in _LAYOUT_FIELDS[1:]:
        if len(d[k]) != d["num_stages"]:
            raise ValueError(f"aceso config: '{k}' has {len(d[k])} entries for {d['num_stages']} stages")


def plan_from_dict(d: Dict[str, Any], num_ops: int = None) -> Plan:
    check_plan_fields(d)
    model = f"{d['model_name']}-{str(d['model_size']).replace('_', '.').lower()}"
    n = d["num_stages"]
    for k in ("num_gpus", "num_ops_in_each_stage", "model_parallel_size_of_each_op",
              "data_parallel_size_of_each_op", "recompute_ops"):
        if len(d[k]) != n:
            raise ValueError(f"aceso config: '{k}' has {len(d[k])} entries for {n} stages")
    algos = d.get("algo_of_each_op") or [[0] * c for c in d["num_ops_in_each_stage"]]
    stages: List[Stage] = []
    start = 0
    for s in range(n):
        cnt = d["num_ops_in_each_stage"][s]
        tps, dps = d["model_parallel_size_of_each_op"][s], d["data_parallel_size_of_each_op"][s]
        rec, alg = d["recompute_ops"][s], algos[s]
        for name, lst in (("model_parallel_size_of_each_op", tps), ("data_parallel_size_of_each_op", dps),
                          ("recompute_ops", rec), ("algo_of_each_op", alg)):
            if len(lst) != cnt:
                raise ValueError(f"aceso config: stage {s} '{name}' has {len(lst)} ops, "
                                 f"num_ops_in_each_stage says {cnt}")
        if len(set(tps)) != 1 or len(set(dps)) != 1 or len(set(alg)) != 1:
            raise ValueError(
                f"aceso config: stage {s} changes TP/DP/algo between its ops (op-level "
                f"resharding); this model and runtime take one TP, DP and algo per stage — split "
                f"the stage where the sizes change")
        if tps[0] * dps[0] != d["num_gpus"][s]:
            raise ValueError(f"aceso config: stage {s} has num_gpus {d['num_gpus'][s]} but "
                             f"TP {tps[0]} x DP {dps[0]}")
        stages.append(Stage(start, start + cnt, tps[0], dps[0],
                            tuple(int(x) for x in rec) if any(rec) else (), alg[0]))
        start += cnt
    if num_ops is not None and start != num_ops:
        raise ValueError(f"aceso config: stages cover {start} ops, the model has {num_ops}")
    return Plan(model, int(d["micro_batch_size"]), int(d["global_batch_size"]), stages)


def save_plan(path: str, plan: Plan, spec: ModelSpec) -> None:
    d = plan_to_dict(plan, spec)
    with open(path, "w") as f:  # one field per line, lists kept on their line
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items())
                + "\n}\n")


def load_plan(path: str, num_ops: int = None) -> Plan:
    with open(path) as f:
        try:
            d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{path}: not a JSON Aceso config ({e})") from None
    try:
        return plan_from_dict(d, num_ops)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
