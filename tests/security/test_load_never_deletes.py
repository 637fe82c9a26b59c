"""`--load` never deletes what it did not write: a job that reads a live run's folder changes
nothing in it, a second job writing the same folder is refused naming the first, and a later
complete checkpoint without this project's marker (Megatron-LM's, behind a rewound tracker)
survives readers and writers alike. Only a killed save of this project is cleaned, by the job
that writes the folder."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from megatron.checkpointing import ownership as own
from megatron.checkpointing.torch_format import TRACKER, load_checkpoint, read_tracker
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer
from tests.resume_harness import TOTAL, first_half, resume_cfg


def _snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): (os.path.getsize(os.path.join(d, f)),
                                                         os.path.getmtime(os.path.join(d, f)))
            for d, _, fs in os.walk(root) for f in fs}


def _dead_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _reader(rank, world, ckpt):
    t = make_trainer(resume_cfg(world, load=ckpt))
    assert load_checkpoint(t)
    return t.iteration


def _writer(rank, world, ckpt):
    from megatron.checkpointing.torch_format import CheckpointError
    t = make_trainer(resume_cfg(world, save=ckpt, load=ckpt))
    try:
        load_checkpoint(t)
    except CheckpointError as e:
        return str(e)
    return t.iteration


@pytest.fixture
def saved(tmp_path):
    run_distributed(first_half, 1, str(tmp_path), {})
    assert read_tracker(str(tmp_path)) == TOTAL // 2
    return tmp_path


def _live_run(root, iteration):
    """What a run that is saving `iteration` right now has on disk: its writer lock and a marked,
    manifest-less iteration folder. This test process plays the live writer."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": own._start_time(os.getpid()),
          "job": "live-run", "since": 0}
    (root / own.LOCK).write_text(json.dumps(me))
    it_dir = root / f"iter_{iteration:07d}"
    (it_dir / "mp_rank_00").mkdir(parents=True)
    (it_dir / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"half written")
    (it_dir / own.MARKER).write_text(json.dumps(me))


def test_reader_of_a_live_runs_folder_changes_nothing(saved):
    _live_run(saved, TOTAL)
    before = _snapshot(saved)
    assert run_distributed(_reader, 2, str(saved)) == [TOTAL // 2] * 2
    assert _snapshot(saved) == before  # the live run's save in progress is still there, untouched


def test_second_writer_is_refused_naming_the_first(saved):
    _live_run(saved, TOTAL)
    before = _snapshot(saved)
    msgs = run_distributed(_writer, 2, str(saved))
    assert f"pid {os.getpid()}" in msgs[0] and "job live-run" in msgs[0] and "two jobs must not write" in msgs[0]
    assert "\n" not in msgs[0] and "rank 0 could not take" in msgs[1], msgs
    assert _snapshot(saved) == before


def test_rewound_tracker_keeps_a_later_checkpoint_without_manifest(saved):
    later = saved / f"iter_{TOTAL * 2:07d}"
    shutil.copytree(saved / f"iter_{TOTAL // 2:07d}", later)
    os.unlink(later / "manifest.json")  # as Megatron-LM writes them: no manifest, no marker
    assert (saved / TRACKER).read_text().strip() == str(TOTAL // 2)
    assert run_distributed(_reader, 1, str(saved)) == [TOTAL // 2]
    assert later.is_dir()
    assert run_distributed(_writer, 1, str(saved)) == [TOTAL // 2]  # the writer does not touch it either
    assert sorted(os.listdir(later)) == ["mp_rank_00"]


def test_writer_cleans_only_a_dead_writers_marked_save(saved):
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "job": "killed"}
    (saved / own.LOCK).write_text(json.dumps(dead))  # the killed run's lock: taken over
    killed, foreign = saved / f"iter_{TOTAL:07d}", saved / f"iter_{TOTAL + 1:07d}"
    for d in (killed, foreign):
        (d / "mp_rank_00").mkdir(parents=True)
        (d / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (killed / own.MARKER).write_text(json.dumps(dead))
    assert run_distributed(_writer, 1, str(saved)) == [TOTAL // 2]
    assert not killed.exists() and foreign.is_dir()


def test_reused_pid_does_not_keep_a_lock(tmp_path):
    # the pid is alive (this process) but started at another time: its writer is gone
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "start": "1", "job": "old"}
    (tmp_path / own.LOCK).write_text(json.dumps(rec))
    mine = own.claim(str(tmp_path))
    try:
        assert json.loads((tmp_path / own.LOCK).read_text())["job"] == mine["job"] != "old"
    finally:
        own.release(str(tmp_path))
    assert not (tmp_path / own.LOCK).exists()
