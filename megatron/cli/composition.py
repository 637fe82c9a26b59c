"""Which systems compose: every pair of features, probed through the real argument parser.

A feature is the flags that turn one system on, added to a small GPT base. `probe_pair` parses
the base plus both features' flags with `config_from_args` (as `pretrain_gpt.py` does) and
returns None when the configuration is accepted, else the one-line reason the program prints.
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
    needs: frozenset = frozenset()   # parallel dims it needs > 1: "tp", "pp", "dp"
    multitask: bool = False          # trains on (input, target) data
    aceso: bool = False              # sets its own per-stage layout from an Aceso config
    cannot_test: Tuple[str, str] = ("", "")  # (parallel dim, why the smoke runs cannot give it that dim)


_RC_FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
FEATURES: Dict[str, Feature] = {
    "dynapipe": Feature("DynaPipe", ("--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json",
                                     "--dynapipe-cost-model-any", "--dynapipe-planner-workers", "0",
                                     "--dynapipe-memory-limit", "400"), multitask=True,
                        cannot_test=("tp", "the shipped CPU cost model (cost_models/cpu_tiny_gpt.json) profiles TP 1 "
                                           "only, so the pair smoke runs cannot plan DynaPipe at TP > 1 (a dedicated "
                                           "test writes its own TP 2 copy)")),
    "terapipe": Feature("TeraPipe", ("--terapipe", "--terapipe-slices", "2"), frozenset({"pp"})),
    # its config (aceso_config) runs TP 2 x DP 1 then TP 1 x DP 2: every parallel dim is there
    "aceso": Feature("Aceso layout", (), frozenset({"tp", "pp", "dp"}), aceso=True),
    "cb_lep": Feature("Optimus-CC CB/LEP", ("--inter-grad-comp", "--use-error-feedback"), frozenset({"pp"})),
    "powersgd": Feature("PowerSGD DP", ("--grad-comp",), frozenset({"dp"})),
    "embsync": Feature("fused embedding sync", ("--emb-comm-opt",), frozenset({"pp"})),
    "distopt": Feature("distributed optimizer", ("--use-distributed-optimizer",), frozenset({"dp"})),
    "sp": Feature("sequence parallel", ("--sequence-parallel",), frozenset({"tp"})),
    "interleaved": Feature("interleaved schedule", ("--num-layers-per-virtual-pipeline-stage", "1"),
                           frozenset({"pp"})),
    "packing": Feature("packing", ("--pack-dataset",), multitask=True),
    "rc_full": Feature("recompute full", _RC_FULL),
    "rc_sel": Feature("recompute selective", ("--recompute-granularity", "selective")),
    "fp16": Feature("fp16", ("--fp16",)),
    "bf16": Feature("bf16", ("--bf16",)),
}

# Two settings of one flag: not a pair anyone can ask for, so not probed.
SAME_FLAG: Dict[Tuple[str, str], str] = {
    ("rc_full", "rc_sel"): "two values of --recompute-granularity",
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
PROOFS: Dict[Tuple[str, str], str] = {
    ("dynapipe", "terapipe"): "tests/training/test_dynapipe_terapipe.py::test_dynapipe_terapipe_two_slices_equals_plain_dynapipe",
    ("dynapipe", "aceso"): _HETERO + "test_hetero_compose.py::test_dynapipe_on_heterogeneous_stages_matches_whole_batch_step",
    ("dynapipe", "cb_lep"): _DYN_CC + "test_compressed_backprop_with_lep_at_full_rank_equals_plain_dynapipe",
    ("dynapipe", "powersgd"): _DYN_CC + "test_powersgd_and_fused_embedding_sync_at_full_rank_equal_plain_dynapipe[False]",
    ("dynapipe", "embsync"): _DYN_CC + "test_fused_embedding_sync_alone_is_exact_on_dynapipe",
    ("dynapipe", "distopt"): _DYN_CC + "test_powersgd_and_fused_embedding_sync_at_full_rank_equal_plain_dynapipe[True]",
    ("dynapipe", "interleaved"): "tests/training/test_dynapipe_interleaved_training.py::test_dynapipe_interleaved_equals_plain_dynapipe",
    ("interleaved", "packing"): "tests/training/test_interleaved_multitask.py::"
                                "test_interleaved_multitask_pp2_matches_plain_pipeline[packing-2-480]",
    ("dynapipe", "sp"): "tests/training/test_dynapipe_sequence_parallel.py::test_dynapipe_sequence_parallel_tp2_pp2_equals_whole_batch_step",
    ("terapipe", "aceso"): _HETERO + "test_hetero_compose.py::test_terapipe_on_heterogeneous_stages_matches_single_process",
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
    ("aceso", "powersgd"): _HETERO + "test_hetero_compression.py::test_powersgd_over_a_stage_dp_group_equals_the_uniform_layout",
    ("aceso", "embsync"): _HETERO + "test_hetero_compression.py::test_powersgd_over_a_stage_dp_group_equals_the_uniform_layout",
    ("aceso", "distopt"): _HETERO + "test_hetero_grads.py::test_distributed_optimizer_shards_over_each_stage_dp_group",
    ("aceso", "sp"): _HETERO + "test_hetero_sequence_parallel.py::test_sequence_parallel_stages_match_single_process[tp2-dp2]",
    ("aceso", "packing"): _HETERO + "test_hetero_compose.py::"
                          "test_multitask_data_on_heterogeneous_stages_matches_whole_batch_step[packing]",
    ("powersgd", "distopt"): "tests/compression/test_distributed_optimizer_compression.py::"
                             "test_powersgd_with_the_distributed_optimizer_equals_it_with_the_plain_optimizer",
    ("embsync", "distopt"): "tests/compression/test_fused_embedding_with_optimizers.py::"
                            "test_fused_embedding_sync_with[distributed-optimizer]",
    ("cb_lep", "powersgd"): _EVERY_CC,
    ("cb_lep", "embsync"): _EVERY_CC,
    ("powersgd", "embsync"): _EVERY_CC,
    ("sp", "rc_full"): _SP + "[tp2_full_recompute-2-kw3]",
    ("sp", "rc_sel"): _SP + "[tp2_selective_recompute-2-kw2]",
}
SMOKE_TEST = "tests/cli/test_composition.py::test_pair_smoke"

BASE = ("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "64", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2", "--lr", "1e-3",
        "--eval-interval", "1000", "--log-interval", "1000", "--seed", "1234")
PROBE_WORLD = 8   # TP 2 x PP 2 x DP 2: every feature's needs fit


def pairs() -> List[Tuple[str, str]]:
    return list(itertools.combinations(FEATURES, 2))


def layout(names: Sequence[str], world: int) -> Tuple[int, int, int]:
    """(TP, PP, DP) for `world` ranks giving every named feature the dims it needs."""
    needs = set().union(*(FEATURES[n].needs for n in names))
    if world >= 8:
        return 2, 2, world // 4
    order = [d for d in ("pp", "tp", "dp") if d in needs] + [d for d in ("pp", "dp", "tp") if d not in needs]
    dims = {d: 1 for d in ("tp", "pp", "dp")}
    left = world
    for d in order:
        if left >= 2:
            dims[d], left = 2, left // 2
    dims["dp"] *= left
    return dims["tp"], dims["pp"], dims["dp"]


def aceso_config(world: int) -> dict:
    """A 2-stage Aceso config for BASE's 4-layer GPT whose stages have their own TP and DP
    (world 8: TP 2 x DP 2 then TP 1 x DP 4; world 4: TP 2 x DP 1 then TP 1 x DP 2)."""
    shapes = [(2, 2), (1, 4)] if world >= 8 else [(2, 1), (1, 2)]
    ops_per_layer = 13  # Aceso's operators per GPT layer
    counts = [1 + 2 * ops_per_layer, 2 * ops_per_layer + 2]  # embedding | final norm + output
    return {"model_name": "gpt", "model_size": "tiny", "num_layers": 4, "global_batch_size": 16,
            "micro_batch_size": 4, "num_stages": 2, "num_gpus": [t * d for t, d in shapes],
            "checkpoint_activations": [False, False], "resharding_stages": [False, False],
            "num_ops_in_each_stage": counts,
            "model_parallel_size_of_each_op": [[t] * c for (t, _), c in zip(shapes, counts)],
            "data_parallel_size_of_each_op": [[d] * c for (_, d), c in zip(shapes, counts)],
            "recompute_ops": [[0] * c for c in counts], "algo_of_each_op": [[0] * c for c in counts]}


def argv(names: Sequence[str], world: int, aceso_path: str, data: Tuple[str, str]) -> List[str]:
    """The command line of BASE + the named features at `world` ranks (`data`: input and target
    prefixes for multi-task features)."""
    out = list(BASE)
    if any(FEATURES[n].aceso for n in names):
        out += ["--aceso-config", aceso_path]
    else:
        tp, pp, dp = layout(names, world)
        out += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--micro-batch-size", "2", "--global-batch-size", str(4 * dp)]
    if any(FEATURES[n].multitask for n in names):
        out += ["--data-path", data[0], "--targets-data-path", data[1], "--split", "100,0,0",
                "--tokenizer-type", "NullTokenizer", "--tokens-per-global-batch", "256"]
    else:
        out += ["--mock-data"]
    for n in names:
        out += list(FEATURES[n].flags)
    return out


def probe(names: Sequence[str], world: int = PROBE_WORLD, workdir: Optional[str] = None,
          data: Tuple[str, str] = ("in", "tg")) -> Optional[str]:
    """None if `pretrain_gpt.py` accepts the features together, else the reason it prints."""
    from megatron.cli.arguments import build_parser, config_from_args
    from megatron.config.errors import ConfigError
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(workdir or tmp, f"aceso_w{world}.json")
        with open(path, "w") as f:
            json.dump(aceso_config(world), f)
        try:
            config_from_args(build_parser("gpt").parse_args(argv(names, world, path, data)), "gpt", world)
        except ConfigError as e:
            return str(e)
    return None


def probe_all() -> Dict[Tuple[str, str], Optional[str]]:
    """{(a, b): None if accepted else the refusal} for every pair not in SAME_FLAG."""
    return {p: probe(p) for p in pairs() if p not in SAME_FLAG}


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


def smoke_groups(results: Dict[Tuple[str, str], Optional[str]]) -> List[Tuple[str, ...]]:
    """Feature sets that, trained together once each, cover every accepted pair without a
    dedicated test. Greedy: start from the first uncovered pair, add the feature covering the
    most uncovered pairs whose every pair with the set is accepted, while the parser accepts
    the whole set and its parallel needs fit SMOKE_WORLD ranks (two of TP/PP/DP at 2)."""
    ok = {p for p, r in results.items() if r is None}
    todo = [p for p in pairs() if p in ok and p not in PROOFS and _untestable(p) is None]
    left = set(todo)
    names = list(FEATURES)
    groups: List[Tuple[str, ...]] = []

    def fits(group):  # (an Aceso config brings its own layout)
        needs = set().union(*(FEATURES[n].needs for n in group))
        own_layout = any(FEATURES[n].aceso for n in group)
        return (own_layout or len(needs) <= 2) and _untestable(group) is None and probe(group, SMOKE_WORLD) is None

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


def untested(results: Dict[Tuple[str, str], Optional[str]]) -> Dict[Tuple[str, str], str]:
    """Accepted pairs no test here can train, with the reason."""
    return {p: _untestable(p) for p, r in results.items()
            if r is None and p not in PROOFS and _untestable(p) is not None}


def smoke_id(group: Sequence[str]) -> str:
    return "-".join(group)


def proof(pair: Tuple[str, str], groups: Optional[List[Tuple[str, ...]]] = None) -> Optional[str]:
    """The test node id that trains `pair` (its dedicated test, or the smoke run covering it)."""
    if pair in PROOFS:
        return PROOFS[pair]
    for g in groups or []:
        if pair[0] in g and pair[1] in g:
            return f"{SMOKE_TEST}[{smoke_id(g)}]"
    return None


def markdown(results: Optional[Dict[Tuple[str, str], Optional[str]]] = None) -> str:
    """The README's composition section: a matrix (✓Tn / ✓Sn works, proved by dedicated test n or
    smoke set n; ✗n refused; ? accepted but untested; — same flag), then the refusals with their
    reasons, the dedicated tests and the smoke sets."""
    results = probe_all() if results is None else results
    names = list(FEATURES)
    refusals: List[Tuple[Tuple[str, str], str]] = [(p, r) for p, r in results.items() if r is not None]
    gaps = untested(results)
    groups = smoke_groups(results)
    tests = list(dict.fromkeys(t for p, t in PROOFS.items() if results.get(p, "") is None))
    number = {p: i + 1 for i, (p, _) in enumerate(refusals)}

    def cell(p):
        if p in SAME_FLAG:
            return "—"
        if p in number:
            return f"✗{number[p]}"
        if p in gaps:
            return "?"
        if p in PROOFS:
            return f"✓T{tests.index(PROOFS[p]) + 1}"
        return f"✓S{next(k + 1 for k, g in enumerate(groups) if p[0] in g and p[1] in g)}"  # the first set

    lines = ["| | " + " | ".join(f"{i + 1}" for i in range(len(names))) + " |",
             "| --- | " + " | ".join("---" for _ in names) + " |"]
    for i, a in enumerate(names):
        cells = ["·" if i == j else cell((a, b) if i < j else (b, a)) for j, b in enumerate(names)]
        lines.append(f"| {i + 1} {FEATURES[a].label} | " + " | ".join(cells) + " |")
    lines += ["", "— " + "; ".join(f"{FEATURES[a].label} × {FEATURES[b].label}: {why}"
                                    for (a, b), why in SAME_FLAG.items()), "",
              "Refused (the line `pretrain_gpt.py` prints):", ""]
    lines += [f"{number[p]}. {FEATURES[p[0]].label} × {FEATURES[p[1]].label}: {r}" for p, r in refusals]
    if gaps:
        lines += ["", "? Accepted, but no test trains it:", ""]
        lines += [f"- {FEATURES[a].label} × {FEATURES[b].label}: {why}" for (a, b), why in gaps.items()]
    lines += ["", "Works, proved by a dedicated test (T):", ""]
    lines += [f"- T{k + 1} `{t}`: " + ", ".join(f"{FEATURES[a].label} × {FEATURES[b].label}"
                                                 for (a, b), u in PROOFS.items() if u == t) for k, t in enumerate(tests)]
    lines += ["", f"Works, proved by training a set of features together for 2 iterations on {SMOKE_WORLD} ranks "
              f"(S; every pair inside the set; `{SMOKE_TEST}[<set>]`):", ""]
    lines += [f"- S{k + 1} `{smoke_id(g)}`: " + ", ".join(FEATURES[n].label for n in g) for k, g in enumerate(groups)]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- composition table: python -m megatron.cli.composition --markdown -->", "<!-- end composition table -->"


def readme_section(readme_text: str) -> Optional[str]:
    """The generated part of the README (between BEGIN and END), or None if it has none."""
    if BEGIN not in readme_text or END not in readme_text:
        return None
    return readme_text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv_: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.cli.composition",
                                description="Probe every pair of systems through the argument parser.")
    p.add_argument("--markdown", action="store_true", help="print the README's composition table")
    p.add_argument("--update-readme", metavar="README", default=None,
                   help="rewrite the table between the markers in this README in place")
    a = p.parse_args(argv_)
    text = markdown()
    if a.update_readme:
        with open(a.update_readme) as f:
            old = f.read()
        if readme_section(old) is None:
            print(f"{a.update_readme}: no '{BEGIN}' ... '{END}' markers; add them where the table goes")
            return 2
        head, rest = old.split(BEGIN, 1)
        new = head + BEGIN + "\n" + text + END + rest.split(END, 1)[1]
        write_text(a.update_readme, new)
        return 0
    if a.markdown:
        print(text, end="")
    else:
        for (x, y), r in probe_all().items():
            print(f"{x} x {y}: {'works' if r is None else 'refused: ' + r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
