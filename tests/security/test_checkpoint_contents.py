"""Well-formed checkpoints with the wrong contents (checksums and manifest rewritten to match,
so only the contents checks stand): a list for the state dict, no `model`, a string iteration,
a bad RNG state, weights of the wrong shape. Each is one line from the rank that read the file,
naming it; the other rank says which rank failed (PP2: each rank reads its own file)."""
import hashlib
import json
import os

import pytest
import torch

from megatron.checkpointing.torch_format import checkpoint_path
from tests.dist_harness import run_distributed
from tests.resume_harness import TOTAL, first_half
from tests.checkpointing.test_checkpointing import _load_expect_error


def _rewrite(path, state):
    """What a careless colleague's script does: save, then fix up the checksum and manifest."""
    torch.save(state, path)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    open(path + ".sha256", "w").write(f"{digest}  model_optim_rng.pt\n")
    it_dir = os.path.dirname(os.path.dirname(path))
    man = json.load(open(os.path.join(it_dir, "manifest.json")))
    rel = os.path.relpath(path, it_dir)
    man["files"][rel] = {"sha256": digest, "bytes": os.path.getsize(path)}
    json.dump(man, open(os.path.join(it_dir, "manifest.json"), "w"))


def _wrong_shape(state):
    (sid,) = state["model"]
    name = next(k for k, v in state["model"][sid].items() if v.dim() == 2)
    state["model"][sid][name] = torch.zeros(3, 3)
    return state


CASES = {
    "list": (lambda s: [s], "holds a list, not a state dict"),
    "no_model": (lambda s: {k: v for k, v in s.items() if k != "model"}, "field 'model' is missing"),
    "string_iteration": (lambda s: dict(s, iteration="2"), "field 'iteration' is str"),
    "bad_rng": (lambda s: dict(s, rng_state=dict(s["rng_state"], random=(3, "x", None))), "RNG state do not fit"),
    "wrong_shape": (_wrong_shape, "do not fit this model"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp2")
    run_distributed(first_half, 2, str(root), dict(pp=2))
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_contents_are_one_line_from_the_rank_that_read_them(saved, tmp_path, case):
    import shutil
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    path = checkpoint_path(str(root), TOTAL // 2, 0, 1, 2)  # pipeline rank 1's file only
    forge, words = CASES[case]
    _rewrite(path, forge(torch.load(path, weights_only=True)))
    msgs = run_distributed(_load_expect_error, 2, str(root), dict(pp=2))
    assert all("\n" not in m and "Traceback" not in m for m in msgs), msgs
    assert path in msgs[1] and words in msgs[1], msgs[1]
    assert "global rank 1 could not load its checkpoint" in msgs[0], msgs[0]
