"""--ckpt-format torch_dist: bit-exact resume at the same layout, and a checkpoint saved at one
TP/PP layout loads at another (no converter) with the same weights and the same loss."""
import json
import os

import pytest
import torch

from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
from megatron.checkpointing.dist_format import read_index
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, make_trainer, shards
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, resume_cfg


def _cfg(world, save=None, load=None, **kw):
    return resume_cfg(world, save, load, fmt="torch_dist", **kw)


def _first_half(rank, world, ckpt, kw):
    return first_half(rank, world, ckpt, dict(kw, fmt="torch_dist"))


@pytest.mark.parametrize("world,kw", [(1, {}), (4, dict(tp=2, pp=2))])
def test_torch_dist_resume_is_bit_exact(tmp_path, world, kw):
    def check_saved(path):
        it_dir = path / f"iter_{TOTAL // 2:07d}"
        index = read_index(str(it_dir))  # readable without a model
        assert "model.decoder.layers.3.self_attention.query_key_value.weight" in index
        files = json.load(open(it_dir / "manifest.json"))["files"]
        assert ".metadata" in files and "common.json" in files
        assert len([f for f in files if f.endswith(".distcp")]) == world  # every rank wrote its part
    assert_resume_bit_exact(tmp_path, world, dict(kw, fmt="torch_dist"), check_saved)


def _step_after_load(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, load=ckpt, **kw))
    assert load_checkpoint(t)
    before = shards(t)
    loss = t.train_step()["loss"]
    return before, loss


def test_torch_dist_loads_at_another_layout(tmp_path):
    # No dropout: RNG streams are per rank and start afresh at another layout.
    saved = assemble(run_distributed(_first_half, 2, str(tmp_path), dict(tp=2, dropout=0.0)))
    (_, ref_loss), _ = run_distributed(_step_after_load, 2, str(tmp_path), dict(tp=2, dropout=0.0))
    for world, kw in ((1, dict(dropout=0.0)), (2, dict(pp=2, dropout=0.0))):
        out = run_distributed(_step_after_load, world, str(tmp_path), kw)
        loaded = assemble([o[0] for o in out])
        assert set(loaded) == set(saved)
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), (kw, name)
        loss = out[-1][1]  # the last pipeline stage reports the loss
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (kw, loss, ref_loss)


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forged_dcp_index_is_refused_without_running(tmp_path):
    import pickle
    it_dir = tmp_path / "iter"
    it_dir.mkdir()
    marker = tmp_path / "pwned"
    (it_dir / ".metadata").write_bytes(pickle.dumps(_Hostile(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: refused to load: GLOBAL posix\.system"):
        read_index(str(it_dir))
    assert not marker.exists()


def _load_error(rank, world, ckpt):
    from megatron.checkpointing.torch_format import CheckpointError
    t = make_trainer(_cfg(world, load=ckpt))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_corrupted_shard_is_named(tmp_path):
    run_distributed(_first_half, 1, str(tmp_path), {})
    it_dir = tmp_path / f"iter_{TOTAL // 2:07d}"
    (shard,) = [f for f in os.listdir(it_dir) if f.endswith(".distcp")]
    data = bytearray((it_dir / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (it_dir / shard).write_bytes(bytes(data))
    (msg,) = run_distributed(_load_error, 1, str(tmp_path))
    assert "no torch_dist checkpoint" in msg and f"{it_dir / shard} is corrupted" in msg, msg


def _continue_and_save(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, save=ckpt, load=ckpt, **kw))
    assert load_checkpoint(t)
    t.train()
    save_checkpoint(t)
    return t.iteration


def _loaded_iteration(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, load=ckpt, **kw))
    assert load_checkpoint(t)
    return t.iteration


def test_corrupted_newest_falls_back_to_the_older_checkpoint(tmp_path, capfd):
    run_distributed(_first_half, 2, str(tmp_path), dict(pp=2))
    assert run_distributed(_continue_and_save, 2, str(tmp_path), dict(pp=2)) == [TOTAL, TOTAL]
    it_dir = tmp_path / f"iter_{TOTAL:07d}"
    shard = sorted(f for f in os.listdir(it_dir) if f.endswith(".distcp"))[-1]
    data = bytearray((it_dir / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (it_dir / shard).write_bytes(bytes(data))
    assert run_distributed(_loaded_iteration, 2, str(tmp_path), dict(pp=2)) == [TOTAL // 2, TOTAL // 2]
    err = capfd.readouterr().err
    assert f"{it_dir / shard} is corrupted" in err and f"loading iteration {TOTAL // 2} instead" in err


def test_saving_one_iteration_twice_never_leaves_it_missing(tmp_path):
    from megatron.checkpointing.ownership import claim, release
    from megatron.checkpointing.torch_format import remove_stale_files
    run_distributed(_first_half, 1, str(tmp_path), {})
    run_distributed(_first_half, 1, str(tmp_path), {})  # replaces the complete save beside it
    it = f"iter_{TOTAL // 2:07d}"
    assert sorted(n for n in os.listdir(tmp_path) if n != ".writer.json") == [it, "latest_checkpointed_iteration.txt"]
    assert run_distributed(_loaded_iteration, 1, str(tmp_path), {}) == [TOTAL // 2]
    # killed between the swap's two renames: the old save is put back, a half-written new one removed
    os.replace(tmp_path / it, tmp_path / f"{it}.replaced")
    (tmp_path / f"{it}.saving").mkdir()
    import socket
    import subprocess
    import sys
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (tmp_path / f"{it}.saving" / ".saving.json").write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    claim(str(tmp_path))  # only the job writing the folder cleans it
    try:
        assert sorted(os.path.basename(p) for p in remove_stale_files(str(tmp_path))) == [f"{it}.replaced",
                                                                                          f"{it}.saving"]
    finally:
        release(str(tmp_path))
    assert run_distributed(_loaded_iteration, 1, str(tmp_path), {}) == [TOTAL // 2]


def test_every_combination_parses_with_torch_dist():
    from megatron.cli.arguments import parse_args
    from tests.cli.test_arguments import BASE
    for extra in ([], ["--use-distributed-optimizer"], ["--grad-comp"]):
        cfg = parse_args(BASE + ["--ckpt-format", "torch_dist"] + extra, world_size=2)
        assert cfg.checkpoint.ckpt_format == "torch_dist"
