"""Checkpoints: bit-exact resume, atomic saves, and clear errors for mismatched or broken files."""
import json
import os

import pytest
import torch

from megatron.checkpointing.torch_format import (TRACKER, CheckpointError, checkpoint_path, load_checkpoint, read_tracker,
                                    save_checkpoint)
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, resume_cfg, second_half

def _cfg(world, ckpt_dir=None, load=None, **kw):
    return resume_cfg(world, ckpt_dir, load, **kw)


_first_half, _second_half = first_half, second_half


@pytest.mark.parametrize("world,kw", [(1, {}), (4, dict(tp=2, pp=2)),
                                     (4, dict(pp=2, stage_parallel=[[2, 1], [1, 2]], stage_layers=[1, 3]))])
def test_resume_is_bit_exact(tmp_path, world, kw):
    assert_resume_bit_exact(tmp_path, world, kw)


def _load_expect_error(rank, world, ckpt, kw):
    t = make_trainer(tiny_config(world=world, load=ckpt, **kw))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_layout_mismatch_names_every_flag(tmp_path):
    run_distributed(_first_half, 2, str(tmp_path), dict(tp=2))
    msgs = run_distributed(_load_expect_error, 2, str(tmp_path), dict(pp=2))
    # Saved at TP=2, PP=1; loading at TP=1, PP=2: the TP=1/PP=2 file name does not exist.
    assert "mp_rank_00_000" in msgs[0] and "another TP/PP layout" in msgs[0]


def _mismatch(rank, world, ckpt):
    t = make_trainer(tiny_config(world=world, load=ckpt, hidden=48))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(t)
    return str(e.value)


def test_model_mismatch_names_flag(tmp_path):
    run_distributed(_first_half, 1, str(tmp_path), {})
    (msg,) = run_distributed(_mismatch, 1, str(tmp_path))
    assert "--hidden-size: checkpoint has 32, this run has 48" in msg


def test_truncated_file_and_bad_tracker(tmp_path):
    run_distributed(_first_half, 1, str(tmp_path), {})
    path = checkpoint_path(str(tmp_path), TOTAL // 2, 0, 0, 1)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 3])
    (msg,) = run_distributed(_load_expect_error, 1, str(tmp_path), {})
    assert "no checkpoint under --load" in msg and "verifies" in msg
    os.unlink(path + ".sha256")
    os.unlink(os.path.join(os.path.dirname(os.path.dirname(path)), "manifest.json"))
    # Without a checksum (a checkpoint from before checksums), a torn file is still named.
    (msg,) = run_distributed(_load_expect_error, 1, str(tmp_path), {})
    assert "cannot read checkpoint" in msg and path in msg
    open(os.path.join(tmp_path, TRACKER), "w").write("garbage")
    with pytest.raises(CheckpointError, match="tracker file is corrupt"):
        read_tracker(str(tmp_path))


def _save_crashing(rank, world, ckpt):
    t = make_trainer(_cfg(world, ckpt))
    for _ in range(TOTAL // 2):
        t.train_step()
    save_checkpoint(t)
    t.train_step()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt("simulated crash in the middle of a save")

    torch.save = dying_save
    try:
        save_checkpoint(t)
    except KeyboardInterrupt:
        pass
    finally:
        torch.save = real_save
    return True


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    run_distributed(_save_crashing, 1, str(tmp_path))
    assert read_tracker(str(tmp_path)) == TOTAL // 2
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    run_distributed(_second_half, 1, str(tmp_path), {})  # still loads and trains


# -- integrity: checksums, fallback, stale leftovers, file modes (issue 16) ---------------------

def _save_twice(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, ckpt, iters=TOTAL // 2, **kw))
    t.train_step()
    save_checkpoint(t)
    t.train_step()
    save_checkpoint(t)
    return True


def _load_report(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, load=ckpt, **kw))
    assert load_checkpoint(t)
    return t.iteration, t.consumed_tokens


def _resume_writer(rank, world, ckpt, kw):
    t = make_trainer(_cfg(world, ckpt, load=ckpt, **kw))
    assert load_checkpoint(t)
    return t.iteration


@pytest.mark.parametrize("world,kw", [(1, {}), (2, dict(pp=2))])
def test_flipped_bytes_fall_back_to_previous_checkpoint(tmp_path, capfd, world, kw):
    run_distributed(_save_twice, world, str(tmp_path), kw)
    assert read_tracker(str(tmp_path)) == 2
    path = checkpoint_path(str(tmp_path), 2, 0, world - 1, world if kw else 1)
    with open(path, "r+b") as f:  # 64 bytes flipped in the middle: torch.load would still succeed
        f.seek(os.path.getsize(path) // 2)
        chunk = bytearray(f.read(64))
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    results = run_distributed(_load_report, world, str(tmp_path), kw)
    assert [it for it, _ in results] == [1] * world  # every rank fell back together
    err = capfd.readouterr().err
    assert "CHECKPOINT CORRUPT" in err and path in err
    assert "instead of the tracked iteration 2" in err


def test_every_checkpoint_corrupt_is_an_error(tmp_path):
    run_distributed(_save_twice, 1, str(tmp_path), {})
    for it in (1, 2):
        p = checkpoint_path(str(tmp_path), it, 0, 0, 1)
        with open(p, "r+b") as f:
            f.seek(100)
            f.write(b"\x00" * 16)
    (msg,) = run_distributed(_load_expect_error, 1, str(tmp_path), {})
    assert "no checkpoint under --load" in msg


def test_manifest_modes_and_consumed_tokens_restored(tmp_path):
    import json
    old = os.umask(0o022)
    try:
        run_distributed(_save_twice, 1, str(tmp_path), {})
    finally:
        os.umask(old)
    path = checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    manifest = json.load(open(os.path.join(tmp_path, "iter_0000002", "manifest.json")))
    assert list(manifest["files"]) == ["mp_rank_00/model_optim_rng.pt"]
    assert manifest["files"]["mp_rank_00/model_optim_rng.pt"]["bytes"] == os.path.getsize(path)
    for f in (path, os.path.join(tmp_path, TRACKER)):
        assert os.stat(f).st_mode & 0o777 == 0o644, f
    ((it, tokens),) = run_distributed(_load_report, 1, str(tmp_path), {})
    assert it == 2 and tokens == 2 * 8 * 16  # two global batches of 8 samples x 16 tokens


def test_stale_temporaries_and_incomplete_folders_removed(tmp_path):
    import subprocess
    import sys
    run_distributed(_save_twice, 1, str(tmp_path), {})
    d = os.path.join(tmp_path, "iter_0000002", "mp_rank_00")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    import socket
    stale = os.path.join(d, f".tmp-{socket.gethostname()}-{dead}-abc123")
    live = os.path.join(d, f".tmp-{socket.gethostname()}-{os.getpid()}-def456")
    for f in (stale, live):
        open(f, "wb").write(b"partial")
    killed = os.path.join(tmp_path, "iter_0000003", "mp_rank_00")  # a save killed before its model file
    os.makedirs(killed)
    open(os.path.join(killed, ".tmp-otherhost-1-x"), "wb").write(b"p")
    with open(os.path.join(tmp_path, "iter_0000003", ".saving.json"), "w") as f:  # marked by its (dead) writer
        json.dump({"host": socket.gethostname(), "pid": int(dead), "job": "killed", "start": None}, f)
    run_distributed(_load_report, 1, str(tmp_path), {})  # a reader: changes nothing
    assert os.path.exists(stale) and os.path.exists(os.path.join(tmp_path, "iter_0000003"))
    run_distributed(_resume_writer, 1, str(tmp_path), {})  # the job writing --save cleans
    assert not os.path.exists(stale)
    assert os.path.exists(live)  # its writer (this process) is alive
    assert not os.path.exists(os.path.join(tmp_path, "iter_0000003"))
    assert os.path.exists(os.path.join(tmp_path, "iter_0000002", "manifest.json"))
