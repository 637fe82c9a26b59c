"""A checkpoint cannot run code: files load with weights_only=True, a pickle that calls a
function is refused (file and type named) before anything runs, older files still load."""
import hashlib
import json
import os

import numpy as np
import pytest
import torch

from megatron.checkpointing.safety import UnsafeCheckpointError, safe_load
from megatron.checkpointing.torch_format import CheckpointError, checkpoint_path, load_checkpoint
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config
from tests.checkpointing.test_checkpointing import TOTAL, _first_half
from tools.checkpoint import convert


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_checksums(path):
    """What an attacker does: make the .sha256 and the manifest agree with the new bytes."""
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    open(path + ".sha256", "w").write(f"{digest}  model_optim_rng.pt\n")
    it_dir = os.path.dirname(os.path.dirname(path))
    man = json.load(open(os.path.join(it_dir, "manifest.json")))
    rel = os.path.relpath(path, it_dir)
    man["files"][rel] = {"sha256": digest, "bytes": os.path.getsize(path)}
    json.dump(man, open(os.path.join(it_dir, "manifest.json"), "w"))


def _load(rank, world, ckpt):
    t = make_trainer(tiny_config(world=world, load=ckpt))
    try:
        load_checkpoint(t)
    except CheckpointError as e:
        return "error: " + str(e)
    return f"loaded iteration {t.iteration}, numpy draw {np.random.randint(1 << 30)}"


def test_hostile_pickle_is_refused_and_does_not_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_first_half, 1, ckpt, {})
    path = checkpoint_path(ckpt, TOTAL // 2, 0, 0, 1)
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "pwned"
    state["config"]["note"] = _Hostile(marker)
    torch.save(state, path)
    _rewrite_checksums(path)
    (msg,) = run_distributed(_load, 1, ckpt)
    assert not marker.exists(), "the pickle's os.system call ran"
    assert msg.startswith("error: ") and path in msg and "posix.system" in msg, msg
    assert len(msg.splitlines()) == 1
    # The offline converter reads the same way.
    rc = convert.main(["--load", ckpt, "--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "1",
                       "--target-pipeline-parallel-size", "1"])
    assert rc == 1 and not marker.exists()


def test_saved_checkpoint_is_weights_only_and_legacy_numpy_rng_loads(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_first_half, 1, ckpt, {})
    path = checkpoint_path(ckpt, TOTAL // 2, 0, 0, 1)
    state = torch.load(path, weights_only=True)  # no allowlist needed for what we write now
    (new_way,) = run_distributed(_load, 1, ckpt)
    # An older version of this project stored np.random.get_state() as is (a uint32 array).
    st = state["rng_state"]["numpy"]
    state["rng_state"]["numpy"] = (st["kind"], np.asarray(st["keys"], dtype=np.uint32), st["pos"],
                                   st["has_gauss"], st["cached_gaussian"])
    torch.save(state, path)
    _rewrite_checksums(path)
    (old_way,) = run_distributed(_load, 1, ckpt)
    assert old_way == new_way and old_way.startswith(f"loaded iteration {TOTAL // 2}")
    # ... but an array anywhere else is not what this project ever wrote.
    state["model"]["extra"] = np.zeros(3, dtype=np.uint32)
    torch.save(state, path)
    with pytest.raises(UnsafeCheckpointError, match="model/extra"):
        safe_load(path)
    state["model"]["extra"] = np.zeros(3, dtype=np.float64)  # its dtype class is not even allowlisted
    torch.save(state, path)
    with pytest.raises(UnsafeCheckpointError, match="numpy.dtypes.Float64DType"):
        safe_load(path)
