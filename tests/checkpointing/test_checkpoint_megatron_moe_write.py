"""MoE GPTs written for Megatron-LM (`convert.py --to-megatron --target-expert-parallel-size N`,
megatron_moe_write): Megatron-Core's `--ckpt-format torch` files, one per EP rank. A Megatron
fixture read here and written back holds Megatron's own tensors under Megatron's own names
(padding rows aside), and Megatron-LM core_v0.9.0's `load_checkpoint` + forward reads what is
written (MEGATRON_LM_PYTHONPATH: a core_v0.9.0 checkout and its deps, see
tests/fixtures/megatron/README.md; skipped without it)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.megatron_logits import FIX
from tools.checkpoint import convert

SRC = os.path.join(FIX, "mcore_moe_ep2")
TP1 = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size"]


def _ours(tmp_path):
    ours = str(tmp_path / "ours")
    assert convert.main(["--from-megatron", "--load", SRC, "--save", ours, *TP1, "1"]) == 0
    return ours


def test_megatron_moe_round_trip_gives_megatrons_files(tmp_path):
    ours, back = _ours(tmp_path), str(tmp_path / "back")
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, *TP1, "1",
                         "--target-expert-parallel-size", "2"]) == 0
    for sub in ("mp_rank_00_000", "mp_rank_00_001"):
        theirs = L.safe_load_megatron(os.path.join(SRC, "iter_0000003", sub, "model_optim_rng.pt"))["model"]
        state = L.safe_load_megatron(os.path.join(back, "release", sub, "model_optim_rng.pt"))
        mine = state["model"]
        assert (state["args"].num_experts, state["args"].expert_model_parallel_size) == (4, 2)
        assert mine.keys() == theirs.keys(), sub
        for k, t in theirs.items():
            if t is None:
                assert mine[k] is None, k
            else:  # Megatron's padded vocabulary rows (never used) hold its own init; ours copy the last row
                rows = 101 if k == "embedding.word_embeddings.weight" else t.shape[0]
                assert torch.equal(mine[k][:rows], t[:rows]), (sub, k)


def test_written_at_another_ep_and_pp_reads_back_the_same_model(tmp_path):
    ours, pp2 = _ours(tmp_path), str(tmp_path / "pp2")
    assert convert.main(["--to-megatron", "--load", ours, "--save", pp2, *TP1, "2",
                         "--target-expert-parallel-size", "4"]) == 0
    assert sorted(os.listdir(os.path.join(pp2, "release"))) == ["manifest.json"] + [
        f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(4)]
    _, a, _ = L.read_full(SRC)
    _, b, meta = L.read_full(pp2)
    assert (meta["pp"], a.keys()) == (2, b.keys())
    assert all(torch.equal(a[k][:101], b[k][:101]) for k in a)


def test_what_core_v0_9_cannot_hold_is_refused_in_one_line(tmp_path, capsys):
    from megatron.checkpointing.megatron_base import MegatronCheckpointError
    from megatron.checkpointing.megatron_moe_write import check_writable
    with pytest.raises(MegatronCheckpointError, match="a shared expert.*--ckpt-format torch"):
        check_writable({"moe": {"num_experts": 4, "shared_expert_intermediate_size": 8}}, 1)
    with pytest.raises(MegatronCheckpointError, match="TP 2"):
        check_writable({"moe": {"num_experts": 4}}, 2)
    assert convert.main(["--to-megatron", "--load", _ours(tmp_path), "--save", str(tmp_path / "x"), *TP1, "1",
                         "--target-expert-parallel-size", "3"]) == 1
    assert "does not divide the 4 experts" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PYTHONPATH"),
                    reason="set MEGATRON_LM_PYTHONPATH to a Megatron-LM core_v0.9.0 checkout and its deps (see "
                           "tests/fixtures/megatron/README.md) to run Megatron's own load_checkpoint on our files")
def test_megatrons_load_checkpoint_reads_our_moe_files(tmp_path):
    """Megatron-LM's load_checkpoint (2 processes, EP 2, the all-to-all dispatcher) and forward on
    what --to-megatron wrote: Megatron's logits of the source fixture (measured 0.0)."""
    ours, back = _ours(tmp_path), str(tmp_path / "back")
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, *TP1, "1",
                         "--target-expert-parallel-size", "2"]) == 0
    env = dict(os.environ, PYTHONPATH=os.environ["MEGATRON_LM_PYTHONPATH"])
    out = subprocess.run([sys.executable, os.path.join(FIX, "make_fixtures.py"), "--out", str(tmp_path), "--name",
                          "check", "--experts", "4", "--ep", "2", "--load", back, "--expect",
                          os.path.join(SRC, "logits.pt")], env=env, capture_output=True, text=True, timeout=900)
    m = re.search(r"megatron_load_max_abs_logit_diff=(\S+)", out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    assert float(m.group(1)) < 1e-5
