"""Which systems compose: every pair of features, probed through the real argument parser.

A feature is the flags that turn one system on, added to a small GPT (or T5) base. `probe`
parses the base plus the features' flags with `config_from_args` (as `pretrain_gpt.py` does;
for T5 also `t5_stage_layers`, as `pretrain_t5.py` does) and returns None when the
configuration is accepted, else the one-line reason the program prints. Each model has its own
table (`markdown(model=...)`); T5's rows are the features `pretrain_t5.py` accepts alone.
`PROOFS` names the test that trains each accepted pair; `tests/cli/test_composition.py` checks
that every accepted pair has one, that the named test exists, and that the README's table is
what `python -m megatron.cli.composition --markdown` prints. Pairs without a dedicated test are
proved by that module's pair smoke run (`SMOKE_TEST`).

An entry-point-level tool: it imports `megatron.cli.arguments`; nothing in the package imports it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.atomic import write_text


@dataclass(frozen=True)
class Feature:
    label: str                       # the README's name
    flags: Tuple[str, ...]           # what turns it on
    needs: frozenset = frozenset()   # parallel dims it needs > 1: "tp", "pp", "dp", "cp"
    multitask: bool = False          # trains on (input, target) data
    aceso: bool = False              # sets its own per-stage layout from an Aceso config
    cannot_test: Tuple[str, str] = ("", "")  # (parallel dim, why the smoke runs cannot give it that dim)
    tp1: bool = False                # runs at TP 1 unless a feature of the set needs TP (MoE: TP > 1 needs SP)


_RC_FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
FEATURES: Dict[str, Feature] = {
    "dynapipe": Feature("DynaPipe", ("--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_{model}.json",
                                     "--dynapipe-cost-model-any", "--dynapipe-planner-workers", "0",
                                     "--dynapipe-memory-limit", "400"), multitask=True,
                        cannot_test=("tp", "the shipped CPU cost models (cost_models/cpu_tiny_{gpt,t5}.json) profile "
                                           "TP 1 only, so the pair smoke runs cannot plan DynaPipe at TP > 1 "
                                           "(a dedicated test writes its own TP 2 copy)")),
    "terapipe": Feature("TeraPipe", ("--terapipe", "--terapipe-slices", "2"), frozenset({"pp"})),
    # its config (aceso_config) runs TP 2 x DP 1 then TP 1 x DP 2: every parallel dim is there
    "aceso": Feature("Aceso layout", (), frozenset({"tp", "pp", "dp"}), aceso=True),
    # rank 4: at the default 16 the float32 factors of the tiny models' 16-bit gradients
    # outweigh them (--fp16/--bf16), and compression sends more bytes than it saves
    "cb_lep": Feature("Optimus-CC CB/LEP", ("--inter-grad-comp", "--use-error-feedback", "--inter-grad-comp-rank", "4"),
                      frozenset({"pp"})),
    # rank 4: the default (128) is past the tiny models' widths, where PowerSGD sends raw
    "powersgd": Feature("PowerSGD DP", ("--grad-comp", "--grad-comp-rank", "4"), frozenset({"dp"})),
    "embsync": Feature("fused embedding sync", ("--emb-comm-opt",), frozenset({"pp"})),
    "distopt": Feature("distributed optimizer", ("--use-distributed-optimizer",), frozenset({"dp"})),
    "sp": Feature("sequence parallel", ("--sequence-parallel",), frozenset({"tp"})),
    "interleaved": Feature("interleaved schedule", ("--num-layers-per-virtual-pipeline-stage", "1"),
                           frozenset({"pp"})),
    "packing": Feature("packing", ("--pack-dataset",), multitask=True),
    "cp": Feature("context parallel", ("--context-parallel-size", "2"), frozenset({"cp"})),
    "rc_full": Feature("recompute full", _RC_FULL),
    "rc_sel": Feature("recompute selective", ("--recompute-granularity", "selective")),
    "fp16": Feature("fp16", ("--fp16",)),
    "bf16": Feature("bf16", ("--bf16",)),
    # MoE every other layer (layers 0 and 2 of 4), so that the dense layers still show recompute
    # at work (composition_checks counts their MLPs); at TP > 1 Megatron-Core's MoE needs SP,
    # so a set without the sequence-parallel feature runs at TP 1
    "moe": Feature("MoE (EP 1)", ("--num-experts", "4", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "1e-2"),
                   tp1=True),
    "ep": Feature("expert parallel (EP 2)", ("--num-experts", "4", "--moe-layer-freq", "2", "--moe-aux-loss-coeff",
                                              "1e-2", "--expert-model-parallel-size", "2"),
                  frozenset({"dp"}), tp1=True),
}

# Two settings of one flag: not a pair anyone can ask for, so not probed.
SAME_FLAG: Dict[Tuple[str, str], str] = {
    ("rc_full", "rc_sel"): "two values of --recompute-granularity",
    ("moe", "ep"): "two values of --expert-model-parallel-size",
}

# The dedicated test that trains each accepted pair. Pairs not listed here are proved by the
# smoke run of a feature set that contains them (SMOKE_TEST[<set>], see smoke_groups); a pair
# listed here is left out of the smoke sets. After merging a branch that makes a pair work, add
# its test here.
_EVERY_CC = "tests/compression/test_fused_embedding_and_resume.py::test_resume_with_every_compression_on_is_exact"
_SP = "tests/training/test_sequence_parallel.py::test_sequence_parallel_matches_single_process"
_TP = "tests/training/test_terapipe_composition.py::"
_TP_DP = _TP + "test_terapipe_with_optimizer_and_dp_features_matches_unsliced"
_DYN_CC = "tests/compression/test_dynapipe_compression.py::"
_HETERO = "tests/aceso/"
_CP = "tests/training/test_context_parallel_compose.py::"
_MOE = "tests/training/test_moe_parity.py::"
PROOFS: Dict[Tuple[str, str], str] = {
    ("dynapipe", "terapipe"): "tests/training/test_dynapipe_terapipe.py::"
                              "test_dynapipe_terapipe_two_slices_equals_plain_dynapipe",
    ("dynapipe", "aceso"): _HETERO + "test_hetero_compose.py::"
                           "test_dynapipe_on_heterogeneous_stages_matches_whole_batch_step",
    ("dynapipe", "cb_lep"): _DYN_CC + "test_compressed_backprop_with_lep_at_full_rank_equals_plain_dynapipe",
    ("dynapipe", "powersgd"): _DYN_CC + "test_powersgd_and_fused_embedding_sync_at_full_rank_equal_plain_dynapipe"
                                        "[False]",
    ("dynapipe", "embsync"): _DYN_CC + "test_fused_embedding_sync_alone_is_exact_on_dynapipe",
    ("dynapipe", "distopt"): _DYN_CC + "test_powersgd_and_fused_embedding_sync_at_full_rank_equal_plain_dynapipe"
                                       "[True]",
    ("dynapipe", "interleaved"): "tests/training/test_dynapipe_interleaved_training.py::"
                                 "test_dynapipe_interleaved_equals_plain_dynapipe",
    ("interleaved", "packing"): "tests/training/test_interleaved_multitask.py::"
                                "test_interleaved_multitask_pp2_matches_plain_pipeline[packing-2-480]",
    ("dynapipe", "sp"): "tests/training/test_dynapipe_sequence_parallel.py::"
                        "test_dynapipe_sequence_parallel_tp2_pp2_equals_whole_batch_step",
    ("terapipe", "aceso"): _HETERO + "test_hetero_compose.py::"
                           "test_terapipe_on_heterogeneous_stages_matches_single_process",
    ("terapipe", "cb_lep"): "tests/compression/test_terapipe_compression.py::"
                            "test_full_rank_compressed_slices_with_lep_equal_plain_terapipe",
    ("terapipe", "powersgd"): _TP_DP + "[grad_comp]",
    ("terapipe", "embsync"): _TP_DP + "[emb_comm_opt]",
    ("terapipe", "distopt"): _TP_DP + "[distopt_overlap]",
    ("terapipe", "sp"): _TP + "test_terapipe_sequence_parallel_tp2_pp2_matches_unsliced",
    ("terapipe", "interleaved"): _TP + "test_terapipe_virtual_stages_pp2_matches_unsliced",
    ("terapipe", "packing"): _TP + "test_terapipe_packed_rows_pp2_matches_unsliced",
    ("terapipe", "rc_full"): _TP + "test_terapipe_recompute_pp2_matches_unsliced[full]",
    ("terapipe", "rc_sel"): _TP + "test_terapipe_recompute_pp2_matches_unsliced[selective]",
    ("terapipe", "fp16"): _TP + "test_terapipe_mixed_precision_trains_like_unsliced[fp16]",
    ("terapipe", "bf16"): _TP + "test_terapipe_mixed_precision_trains_like_unsliced[bf16]",
    ("aceso", "cb_lep"): _HETERO + "test_hetero_compression.py::"
                         "test_compressed_pieces_between_stages_equal_single_process_with_the_same_codec[cb-lep]",
    ("aceso", "powersgd"): _HETERO + "test_hetero_compression.py::"
                           "test_powersgd_over_a_stage_dp_group_equals_the_uniform_layout",
    ("aceso", "embsync"): _HETERO + "test_hetero_compression.py::"
                          "test_powersgd_over_a_stage_dp_group_equals_the_uniform_layout",
    ("aceso", "distopt"): _HETERO + "test_hetero_grads.py::test_distributed_optimizer_shards_over_each_stage_dp_group",
    ("aceso", "sp"): _HETERO + "test_hetero_sequence_parallel.py::"
                     "test_sequence_parallel_stages_match_single_process[tp2-dp2]",
    ("aceso", "packing"): _HETERO + "test_hetero_compose.py::"
                          "test_multitask_data_on_heterogeneous_stages_matches_whole_batch_step[packing]",
    ("powersgd", "distopt"): "tests/compression/test_distributed_optimizer_compression.py::"
                             "test_powersgd_with_the_distributed_optimizer_equals_it_with_the_plain_optimizer",
    ("embsync", "distopt"): "tests/compression/test_fused_embedding_with_optimizers.py::"
                            "test_fused_embedding_sync_with[distributed-optimizer]",
    ("cb_lep", "powersgd"): _EVERY_CC,
    ("cb_lep", "embsync"): _EVERY_CC,
    ("powersgd", "embsync"): _EVERY_CC,
    ("distopt", "cp"): _CP + "test_cp_distributed_optimizer_shards_over_dp_x_cp",
    ("sp", "cp"): _CP + "test_cp_sequence_parallel_rope_matches_single_process",
    ("packing", "cp"): _CP + "test_cp_multitask_equals_whole_batch_step[packing-2-2-1-1]",
    ("dynapipe", "cp"): _CP + "test_cp_multitask_equals_whole_batch_step[dynapipe-4-2-2-1]",
    ("cp", "rc_full"): _CP + "test_cp_dropout_matches_keyed_single_process[cp2_p2p_full_recompute]",
    ("cp", "rc_sel"): _CP + "test_cp_dropout_matches_keyed_single_process[cp2_tp2_sp_selective]",
    ("sp", "rc_full"): _SP + "[tp2_full_recompute-2-kw3]",
    ("sp", "rc_sel"): _SP + "[tp2_selective_recompute-2-kw2]",
    ("sp", "moe"): _MOE + "test_tensor_parallel_with_sequence_parallel",
    ("sp", "ep"): _MOE + "test_tensor_parallel_with_sequence_parallel",
    ("interleaved", "ep"): _MOE + "test_interleaved_schedule_with_expert_parallelism",
    ("rc_full", "ep"): _MOE + "test_expert_parallel_matches_single_process[dropless-ep2_full_recompute]",
    ("dynapipe", "ep"): "tests/training/test_dynapipe_moe.py::test_dynapipe_ep2_equals_whole_batch_step[alltoall-1]",
}
SMOKE_TEST = "tests/cli/test_composition.py::test_pair_smoke"

# pretrain_t5.py's pairs with a dedicated test (the others: its smoke sets, SMOKE_TESTS["t5"]).
_T5 = "tests/cli/test_composition_t5.py::"
PROOFS_T5: Dict[Tuple[str, str], str] = {
    ("aceso", "cb_lep"): _T5 + "test_t5_aceso_layout_with_compressed_backprop_compresses_and_is_exact",
    ("cb_lep", "powersgd"): _T5 + "test_t5_full_rank_compression_equals_the_plain_run",
}
PROOFS_BY_MODEL = {"gpt": PROOFS, "t5": PROOFS_T5}
# Pairs whose dedicated test is an expected failure: kept out of every smoke set too, so that
# one known defect fails one test. T5 x Aceso x CB: t5_trainer.py replaces the compression plan
# pass with the layout pass (drop the entry once the plan-pass pipeline composes them).
KEEP_APART: Dict[str, set] = {"gpt": set(), "t5": {("aceso", "cb_lep")}}
SMOKE_TESTS = {"gpt": SMOKE_TEST, "t5": "tests/cli/test_composition_t5.py::test_t5_pair_smoke"}
PROGRAMS = {"gpt": "pretrain_gpt.py", "t5": "pretrain_t5.py"}

BASE = ("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "64", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2", "--lr", "1e-3",
        "--eval-interval", "1000", "--log-interval", "1000", "--seed", "1234")
PROBE_WORLD = 8   # TP 2 x PP 2 x DP 2: every feature's needs fit
# The T5 base: 2 encoder + 2 decoder layers; with PP 2 the encoder is rank 0, the decoder rank 1.
T5_BASE = ("--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--encoder-seq-length", "32", "--decoder-seq-length", "16",
           "--max-position-embeddings", "64", "--vocab-size", "97", "--vocab-extra-ids", "5") + BASE[10:]


def pairs(model: str = "gpt") -> List[Tuple[str, str]]:
    """Every pair of features the model's program accepts alone."""
    names = [n for n in FEATURES if model == "gpt" or n not in refused_alone(model)]
    return list(itertools.combinations(names, 2))


_ALONE: Dict[str, Dict[str, str]] = {}


def refused_alone(model: str) -> Dict[str, str]:
    """{feature: the refusal} for features the model's program refuses even alone (GPT: none)."""
    if model not in _ALONE:
        _ALONE[model] = {n: r for n in FEATURES for r in [probe([n], model=model)] if r is not None}
    return _ALONE[model]


def layout(names: Sequence[str], world: int) -> Tuple[int, int, int]:
    """(TP, PP, DP) for `world` ranks giving every named feature the dims it needs (a context-
    parallel feature sets its own CP size 2, which takes a factor 2 of the ranks; a `tp1`
    feature keeps TP 1 unless another feature needs TP)."""
    needs = set().union(*(FEATURES[n].needs for n in names))
    if "cp" in needs:
        world //= 2
    if world >= 8:
        if "tp" not in needs and any(FEATURES[n].tp1 for n in names):
            return 1, 2, world // 2
        return 2, 2, world // 4
    order = [d for d in ("pp", "tp", "dp") if d in needs] + [d for d in ("pp", "dp", "tp") if d not in needs]
    dims = {d: 1 for d in ("tp", "pp", "dp")}
    left = world
    for d in order:
        if left >= 2:
            dims[d], left = 2, left // 2
    dims["dp"] *= left
    return dims["tp"], dims["pp"], dims["dp"]


def aceso_config(world: int, model: str = "gpt") -> dict:
    """A 2-stage Aceso config for BASE's 4-layer GPT (or T5_BASE's 2+2-layer T5: the encoder,
    then the decoder) whose stages have their own TP and DP (world 8: TP 2 x DP 2 then TP 1 x
    DP 4; world 4: TP 2 x DP 1 then TP 1 x DP 2)."""
    shapes = [(2, 2), (1, 4)] if world >= 8 else [(2, 1), (1, 2)]
    if model == "t5":
        from megatron.aceso.t5_layout import DEC_OPS, ENC_OPS
        # embedding + 2 encoder layers + final norm | embedding + 2 decoder layers + final norm + output
        counts = [1 + 2 * ENC_OPS + 1, 1 + 2 * DEC_OPS + 2]
        name, layers = "t5", [2, 2]
    else:
        ops_per_layer = 13  # Aceso's operators per GPT layer
        counts = [1 + 2 * ops_per_layer, 2 * ops_per_layer + 2]  # embedding | final norm + output
        name, layers = "gpt", 4
    return {"model_name": name, "model_size": "tiny", "num_layers": layers, "global_batch_size": 16,
            "micro_batch_size": 4, "num_stages": 2, "num_gpus": [t * d for t, d in shapes],
            "checkpoint_activations": [False, False], "resharding_stages": [False, False],
            "num_ops_in_each_stage": counts,
            "model_parallel_size_of_each_op": [[t] * c for (t, _), c in zip(shapes, counts)],
            "data_parallel_size_of_each_op": [[d] * c for (_, d), c in zip(shapes, counts)],
            "recompute_ops": [[0] * c for c in counts], "algo_of_each_op": [[0] * c for c in counts]}


def argv(names: Sequence[str], world: int, aceso_path: str, data: Tuple[str, str], model: str = "gpt",
         extra: Sequence[str] = ()) -> List[str]:
    """The command line of the model's base + the named features at `world` ranks (`data`: input
    and target prefixes for multi-task features)."""
    out = list(T5_BASE if model == "t5" else BASE)
    if any(FEATURES[n].aceso for n in names):
        out += ["--aceso-config", aceso_path]
    else:
        tp, pp, dp = layout(names, world)
        out += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--micro-batch-size", "2", "--global-batch-size", str(4 * dp)]
        if model == "t5" and pp > 1:
            out += ["--pipeline-model-parallel-split-rank", str(pp // 2)]
    if any(FEATURES[n].multitask for n in names):
        out += ["--data-path", data[0], "--targets-data-path", data[1], "--split", "100,0,0",
                "--tokenizer-type", "NullTokenizer", "--tokens-per-global-batch", "256"]
    else:
        out += ["--mock-data"]
    for n in names:
        out += [f.format(model=model) for f in FEATURES[n].flags]
    return out + list(extra)


def probe(names: Sequence[str], world: int = PROBE_WORLD, workdir: Optional[str] = None,
          data: Tuple[str, str] = ("in", "tg"), model: str = "gpt", extra: Sequence[str] = ()) -> Optional[str]:
    """None if the model's program accepts the features together, else the reason it prints."""
    from megatron.cli.arguments import build_parser, config_from_args
    from megatron.config.errors import ConfigError
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(workdir or tmp, f"aceso_{model}_w{world}.json")
        with open(path, "w") as f:
            json.dump(aceso_config(world, model), f)
        try:
            cfg = config_from_args(build_parser(model).parse_args(argv(names, world, path, data, model, extra)),
                                  model, world)
            if model == "t5":
                from megatron.models.t5 import t5_stage_layers
                t5_stage_layers(cfg)  # pretrain_t5.py's check before any process group
        except ConfigError as e:
            return str(e)
    return None


def probe_all(model: str = "gpt") -> Dict[Tuple[str, str], Optional[str]]:
    """{(a, b): None if accepted else the refusal} for every pair not in SAME_FLAG."""
    return {p: probe(p, model=model) for p in pairs(model) if p not in SAME_FLAG}


SMOKE_WORLD = 4
SMOKE_MAX = 6   # features per smoke run


def _untestable(group: Sequence[str]) -> Optional[str]:
    """Why no test here can train these features together (None if one can)."""
    needs = set().union(*(FEATURES[n].needs for n in group))
    for n in group:
        dim, why = FEATURES[n].cannot_test
        if dim and dim in needs:
            return why
    return None


def smoke_groups(results: Dict[Tuple[str, str], Optional[str]], model: str = "gpt") -> List[Tuple[str, ...]]:
    """Feature sets that, trained together once each, cover every accepted pair without a
    dedicated test. Greedy: start from the first uncovered pair, add the feature covering the
    most uncovered pairs whose every pair with the set is accepted, while the parser accepts
    the whole set and its parallel needs fit SMOKE_WORLD ranks (two of TP/PP/DP at 2)."""
    ok = {p for p, r in results.items() if r is None}
    proofs = PROOFS_BY_MODEL[model]
    todo = [p for p in pairs(model) if p in ok and p not in proofs and _untestable(p) is None]
    left = set(todo)
    names = [n for n in FEATURES if model == "gpt" or n not in refused_alone(model)]
    groups: List[Tuple[str, ...]] = []

    def fits(group):  # (an Aceso config brings its own layout)
        needs = set().union(*(FEATURES[n].needs for n in group))
        own_layout = any(FEATURES[n].aceso for n in group)
        if any(p in KEEP_APART[model] for p in itertools.combinations(group, 2)):
            return False
        return (own_layout or len(needs) <= 2) and _untestable(group) is None and \
            probe(group, SMOKE_WORLD, model=model) is None

    def key(a, b):
        return (a, b) if names.index(a) < names.index(b) else (b, a)

    for first in todo:
        if first not in left:
            continue
        group = list(first)
        while len(group) < SMOKE_MAX:
            gain = {f: sum(key(f, g) in left for g in group) for f in names
                    if f not in group and all(key(f, g) in ok for g in group)}
            for f in sorted(gain, key=lambda f: (-gain[f], names.index(f))):
                if gain[f] and fits(sorted(group + [f], key=names.index)):
                    group = sorted(group + [f], key=names.index)
                    break
            else:
                break
        groups.append(tuple(group))
        left -= set(itertools.combinations(group, 2))
    return groups


def untested(results: Dict[Tuple[str, str], Optional[str]], model: str = "gpt") -> Dict[Tuple[str, str], str]:
    """Accepted pairs no test here can train, with the reason."""
    return {p: _untestable(p) for p, r in results.items()
            if r is None and p not in PROOFS_BY_MODEL[model] and _untestable(p) is not None}


def smoke_id(group: Sequence[str]) -> str:
    return "-".join(group)


def proof(pair: Tuple[str, str], groups: Optional[List[Tuple[str, ...]]] = None, model: str = "gpt") -> Optional[str]:
    """The test node id that trains `pair` (its dedicated test, or the smoke run covering it)."""
    if pair in PROOFS_BY_MODEL[model]:
        return PROOFS_BY_MODEL[model][pair]
    for g in groups or []:
        if pair[0] in g and pair[1] in g:
            return f"{SMOKE_TESTS[model]}[{smoke_id(g)}]"
    return None


def markdown(results: Optional[Dict[Tuple[str, str], Optional[str]]] = None, model: str = "gpt") -> str:
    """The README's composition section for `model`: a matrix (✓Tn / ✓Sn works, proved by
    dedicated test n or smoke set n; ✗n refused; ? accepted but untested; — same flag), then the
    refusals with their reasons, the dedicated tests and the smoke sets."""
    results = probe_all(model) if results is None else results
    proofs, program = PROOFS_BY_MODEL[model], PROGRAMS[model]
    alone = refused_alone(model) if model != "gpt" else {}
    names = [n for n in FEATURES if n not in alone]
    refusals: List[Tuple[Tuple[str, str], str]] = [(p, r) for p, r in results.items() if r is not None]
    gaps = untested(results, model)
    groups = smoke_groups(results, model)
    tests = list(dict.fromkeys(t for p, t in proofs.items() if results.get(p, "") is None))
    number = {p: i + 1 for i, (p, _) in enumerate(refusals)}

    def cell(p):
        if p in SAME_FLAG:
            return "—"
        if p in number:
            return f"✗{number[p]}"
        if p in gaps:
            return "?"
        if p in proofs:
            return f"✓T{tests.index(proofs[p]) + 1}"
        return f"✓S{next(k + 1 for k, g in enumerate(groups) if p[0] in g and p[1] in g)}"  # the first set

    lines = ["| | " + " | ".join(f"{i + 1}" for i in range(len(names))) + " |",
             "| --- | " + " | ".join("---" for _ in names) + " |"]
    for i, a in enumerate(names):
        cells = ["·" if i == j else cell((a, b) if i < j else (b, a)) for j, b in enumerate(names)]
        lines.append(f"| {i + 1} {FEATURES[a].label} | " + " | ".join(cells) + " |")
    lines += ["", "— " + "; ".join(f"{FEATURES[a].label} × {FEATURES[b].label}: {why}"
                                    for (a, b), why in SAME_FLAG.items()), ""]
    if alone:
        lines += [f"Refused alone by `{program}` (not in the table):", ""]
        lines += [f"- {FEATURES[n].label}: {r}" for n, r in alone.items()] + [""]
    lines += [f"Refused (the line `{program}` prints):", ""]
    lines += [f"{number[p]}. {FEATURES[p[0]].label} × {FEATURES[p[1]].label}: {r}" for p, r in refusals]
    if gaps:
        lines += ["", "? Accepted, but no test trains it:", ""]
        lines += [f"- {FEATURES[a].label} × {FEATURES[b].label}: {why}" for (a, b), why in gaps.items()]
    lines += ["", "Works, proved by a dedicated test (T):", ""]
    lines += [f"- T{k + 1} `{t}`: " + ", ".join(f"{FEATURES[a].label} × {FEATURES[b].label}"
                                                 for (a, b), u in proofs.items() if u == t)
              for k, t in enumerate(tests)]
    lines += ["", f"Works, proved by training a set of features together for 2 iterations on {SMOKE_WORLD} ranks "
              f"with every feature observed at work (S; every pair inside the set; `{SMOKE_TESTS[model]}[<set>]`; "
              "what each feature must show: `tests/cli/composition_checks.py`):", ""]
    lines += [f"- S{k + 1} `{smoke_id(g)}`: " + ", ".join(FEATURES[n].label for n in g) for k, g in enumerate(groups)]
    return "\n".join(lines) + "\n"


BEGIN, END = ("<!-- composition table: python -m megatron.cli.composition --markdown -->",
              "<!-- end composition table -->")
MARKERS = {"gpt": (BEGIN, END),
           "t5": ("<!-- composition table: python -m megatron.cli.composition --model t5 --markdown -->",
                  "<!-- end t5 composition table -->")}


def readme_section(readme_text: str, model: str = "gpt") -> Optional[str]:
    """The generated part of the README (between the model's markers), or None if it has none."""
    begin, end = MARKERS[model]
    if begin not in readme_text or end not in readme_text:
        return None
    return readme_text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def main(argv_: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.cli.composition",
                                description="Probe every pair of systems through the argument parser.")
    p.add_argument("--model", choices=sorted(PROGRAMS), default=None,
                   help="whose program to probe: gpt (pretrain_gpt.py, the default) or t5 (pretrain_t5.py); "
                        "--update-readme rewrites both tables unless one is named")
    p.add_argument("--markdown", action="store_true", help="print the README's composition table")
    p.add_argument("--update-readme", metavar="README", default=None,
                   help="rewrite the tables between the markers in this README in place")
    a = p.parse_args(argv_)
    if a.update_readme:
        with open(a.update_readme) as f:
            new = f.read()
        for model in [a.model] if a.model else sorted(PROGRAMS):
            begin, end = MARKERS[model]
            if readme_section(new, model) is None:
                print(f"{a.update_readme}: no '{begin}' ... '{end}' markers; add them where the table goes")
                return 2
            head, rest = new.split(begin, 1)
            new = head + begin + "\n" + markdown(model=model) + end + rest.split(end, 1)[1]
        write_text(a.update_readme, new)
        return 0
    model = a.model or "gpt"
    if a.markdown:
        print(markdown(model=model), end="")
    else:
        for (x, y), r in probe_all(model).items():
            print(f"{x} x {y}: {'works' if r is None else 'refused: ' + r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
