"""pretrain_t5.py's composition table is true and stays true (as tests/cli/test_composition.py does
for GPT): docs/composition.md's T5 table is generated, every pair pretrain_t5.py accepts names a test,
the smoke sets train with every feature at work, and the compression pairs are exact at full
rank and compress where they should."""
import math
import os

import pytest

from megatron.cli import composition as C
from tests.cli.composition_checks import ROOT, _test_exists, train_groups, write_multitask_data
from tests.dist_harness import run_distributed

RESULTS = C.probe_all("t5")
SMOKE_GROUPS = C.smoke_groups(RESULTS, "t5")
SMOKE_IDS = [C.smoke_id(g) for g in SMOKE_GROUPS]


def test_readme_t5_table_is_generated():
    section = C.readme_section(open(os.path.join(ROOT, "docs", "composition.md")).read(), "t5")
    assert section is not None, f"docs/composition.md has no T5 composition table between the markers " \
                                f"{C.MARKERS['t5']}"
    assert section == C.markdown(RESULTS, "t5"), \
        "docs/composition.md's T5 composition table is stale: run " \
        "`python -m megatron.cli.composition --update-readme docs/composition.md`"


def test_every_accepted_t5_pair_names_an_existing_test():
    works = {p for p, r in RESULTS.items() if r is None}
    gaps = C.untested(RESULTS, "t5")
    missing = [f"{C.proof(p, SMOKE_GROUPS, 't5')} ({p[0]} x {p[1]})" for p in sorted(works) if p not in gaps and
               (C.proof(p, SMOKE_GROUPS, "t5") is None or not _test_exists(C.proof(p, SMOKE_GROUPS, "t5")))]
    assert not missing, "proofs naming no test: " + "; ".join(missing)
    stale = [p for p in C.PROOFS_T5 if p not in works]
    assert not stale, f"PROOFS_T5 names pairs pretrain_t5.py refuses (drop them): {stale}"
    for a, b in C.KEEP_APART["t5"]:
        assert not any(a in g and b in g for g in SMOKE_GROUPS), (a, b)


def test_t5_rows_are_what_pretrain_t5_accepts():
    # what T5 refuses alone (TeraPipe, --emb-comm-opt, --sequence-parallel, virtual stages, CP,
    # MoE) is listed once, not as a row of refusals; everything else is a row
    alone = C.refused_alone("t5")
    assert set(alone) == {"terapipe", "embsync", "sp", "interleaved", "cp", "moe", "ep"}, alone
    assert all("\n" not in why for why in alone.values())
    rows = {n for p in C.pairs("t5") for n in p}
    assert rows == set(C.FEATURES) - set(alone)
    assert RESULTS[("aceso", "cb_lep")] is None  # accepted: so it must train compressed (below)


# -- smoke sets ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    import json
    d = tmp_path_factory.mktemp("composition_t5")
    with open(d / "aceso_t5.json", "w") as f:
        json.dump(C.aceso_config(C.SMOKE_WORLD, "t5"), f)
    data = write_multitask_data(d)
    return run_distributed(train_groups, C.SMOKE_WORLD, SMOKE_GROUPS, str(d), data, "t5", timeout_s=300.0)


@pytest.mark.parametrize("group", SMOKE_GROUPS, ids=SMOKE_IDS)
def test_t5_pair_smoke(group, smoke):
    """The features of `group` train T5 together: 2 iterations, a finite loss, the same on every
    last-stage rank, and every feature at work on every rank (tests/cli/composition_checks.py)."""
    off = [f"rank {r}: {why}" for r, o in enumerate(smoke) for why in o[group][2]]
    assert not off, f"{group}: features accepted but not at work: " + "; ".join(off)
    reported = [losses for losses, last, _ in (o[group] for o in smoke) if last]
    assert reported, f"{group}: no last-stage rank"
    for losses in reported:
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (group, losses)
        assert losses == pytest.approx(reported[0], rel=1e-6), (group, reported)


# -- dedicated tests: compression is on, and exact at full rank ------------------------------
def _run_t5(rank, world, names, extra, workdir, full_rank):
    """Train pretrain_t5.py's configuration of `names` (+ `extra` flags) on this process group;
    with `full_rank` the low-rank codecs are lossless (tests/compression/lossless.py) and count
    the compressions that really ran."""
    from datetime import timedelta

    import torch

    from megatron.cli.arguments import build_parser, config_from_args
    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.t5_builder import build_t5_trainer
    from tests.compression import lossless
    from tests.parity_utils import train_and_record
    from tests.training.test_t5_parity import _shards

    aceso = os.path.join(workdir, "aceso_t5.json")
    args = C.argv(names, world, aceso, ("in", "tg"), "t5") + list(extra) + ["--train-iters", "3"]
    cfg = config_from_args(build_parser("t5").parse_args(args), "t5", world)
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    counts = {}
    if full_rank:
        lossless.lossless()
        counts = lossless.counting()
    trainer = build_t5_trainer(cfg, ps, torch.device("cpu"))
    out = train_and_record(trainer, world, get=lambda what: _shards(trainer, what)[0])
    out["counts"] = dict(counts)
    return out


def _exact_and_compressing(tmp_path, names, plain_names, extra_full, extra_low, world=4):
    """(1) At full rank the compressed run equals the uncompressed one and compressions ran;
    (2) at a low rank the compressed kinds put fewer bytes on the wire than raw."""
    import json

    from tests.parity_utils import assert_parity
    from tests.training.test_t5_parity import _assemble
    with open(tmp_path / "aceso_t5.json", "w") as f:
        json.dump(C.aceso_config(world, "t5"), f)
    plain = run_distributed(_run_t5, world, plain_names, (), str(tmp_path), False)
    full = run_distributed(_run_t5, world, names, extra_full, str(tmp_path), True)
    low = run_distributed(_run_t5, world, names, extra_low, str(tmp_path), False)
    return plain, full, low, assert_parity, _assemble


_FULL = ("--inter-grad-comp-rank", "64", "--grad-comp-rank", "64")  # tests/compression/lossless.FULL_RANK
_LOW = ("--inter-grad-comp-rank", "2", "--grad-comp-rank", "2")


@pytest.mark.parity  # float64 (tests/conftest.py)
def test_t5_aceso_layout_with_compressed_backprop_compresses_and_is_exact(tmp_path):
    """pretrain_t5.py --aceso-config ... --inter-grad-comp --use-error-feedback: the gradients
    between the encoder stage (TP 2 x DP 1) and the decoder stage (TP 1 x DP 2) are compressed
    (fewer bytes than raw at rank 2), and at full rank the run equals the uncompressed layout."""
    plain, full, low, assert_parity, assemble = _exact_and_compressing(
        tmp_path, ("aceso", "cb_lep"), ("aceso",), _FULL, _LOW)
    assert all(o["counts"]["pipeline"] > 0 for o in full if o["is_last"]), \
        [o["counts"] for o in full]
    assert_parity(plain, full, assemble_fn=assemble, codec_roundings=1)
    for step in low[0]["comm_bytes"]:
        assert 0 < step["pp_grad"] < step["pp_grad_raw"], step


@pytest.mark.parity  # float64 (tests/conftest.py)
def test_t5_full_rank_compression_equals_the_plain_run(tmp_path):
    """pretrain_t5.py on PP 2 (encoder | decoder) x DP 2 with --inter-grad-comp
    --use-error-feedback --grad-comp: both codecs run (compressions counted) and at full rank
    the run equals the uncompressed one; at rank 2 both put fewer bytes on the wire than raw."""
    plain, full, low, assert_parity, assemble = _exact_and_compressing(
        tmp_path, ("cb_lep", "powersgd"), (), _FULL, _LOW)  # no features: the same PP 2 x DP 2 layout
    counts = [o["counts"] for o in full]
    assert sum(c["pipeline"] for c in counts) > 0 and sum(c["reducer"] for c in counts) > 0, counts
    assert_parity(plain, full, assemble_fn=assemble, codec_roundings=1)
    for step in low[0]["comm_bytes"]:
        assert 0 < step["pp_grad"] < step["pp_grad_raw"], step
        assert 0 < step["dp"] < step["dp_raw"], step
