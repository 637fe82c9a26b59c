"""--async-save: training goes on while the files are written; the tracker moves only once every
rank's file and the manifest are complete; a kill mid-write leaves the previous checkpoint, and
resuming from an asynchronous save is bit-exact with an uninterrupted run."""
import os
import signal
import threading

import pytest
import torch

from megatron.checkpointing import async_save, torch_format
from megatron.checkpointing.cleanup import MANIFEST
from megatron.checkpointing.ownership import MARKER
from megatron.checkpointing.torch_format import read_tracker
from tests.dist_harness import RankFailed, run_distributed
from tests.resume_harness import TOTAL, make_trainer, resume_cfg, second_half, straight, shards

HALF = TOTAL // 2


def _async_trainer(world, ckpt, kw):
    """A trainer of the TOTAL-iteration run (its data and schedule), stepped to HALF."""
    cfg = resume_cfg(world, ckpt, **kw)
    cfg.checkpoint.async_save = True
    t = make_trainer(cfg)
    for _ in range(HALF):
        t.train_step()
    return t


def _gated_writer(gate: threading.Event):
    """The real writer, started only once `gate` is set (the test decides when the write ends)."""
    real = torch_format.write_rank_file

    def write(path, state):
        assert gate.wait(60), "the test never released the writer"
        real(path, state)
    return write


def _save_while_training(rank, world, ckpt, kw):
    """Save at HALF asynchronously with the last rank's writer held back, train two more steps
    (they change the parameters and Adam moments in place), check nothing names the save yet,
    then release the writer and finalize. The checkpoint must hold the state of iteration HALF."""
    t = _async_trainer(world, ckpt, kw)
    gate = threading.Event()
    if rank == (world - 1 if kw.get("pp", 1) > 1 else 0):  # a rank that writes a file (DP rank 0 does)
        torch_format.write_rank_file = _gated_writer(gate)
    async_save.save_checkpoint_async(t)
    it_dir = os.path.join(ckpt, f"iter_{HALF:07d}")
    for _ in range(2):
        t.train_step()
        # every rank asks; the held-back writer makes every rank answer "not yet"
        assert async_save.maybe_finalize(t) is False
        if rank == 0:
            assert read_tracker(ckpt) is None and not os.path.exists(os.path.join(it_dir, MANIFEST))
            assert os.path.exists(os.path.join(it_dir, MARKER))
    gate.set()
    assert async_save.maybe_finalize(t, blocking=True) is True
    assert read_tracker(ckpt) == HALF and os.path.exists(os.path.join(it_dir, MANIFEST))
    assert not os.path.exists(os.path.join(it_dir, MARKER))
    return True


@pytest.mark.parametrize("world,kw", [(1, {}), (2, dict(pp=2)), (2, dict(dist_opt=True))])
def test_async_save_snapshot_resumes_bit_exact(tmp_path, world, kw):
    ref = run_distributed(straight, world, kw)
    run_distributed(_save_while_training, world, str(tmp_path), kw)
    resumed = run_distributed(second_half, world, str(tmp_path), kw)
    for (a, ca), (b, cb) in zip(ref, resumed):
        assert ca == cb and set(a) == set(b)
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name


def _killed_mid_write(rank, world, ckpt, kw):
    """An asynchronous save at HALF completes; the one at HALF + 1 is killed (SIGKILL, the whole
    process) after its writer has written part of the file."""
    t = _async_trainer(world, ckpt, kw)
    async_save.save_checkpoint_async(t)
    t.train_step()  # iteration HALF + 1; the finalize at the next step or save names HALF
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        if threading.current_thread() is threading.main_thread():
            return real_save(obj, f, *a, **k)
        f.write(b"partial")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = dying_save
    async_save.save_checkpoint_async(t)  # finalizes HALF first, then starts the doomed writer
    assert read_tracker(ckpt) == HALF
    for _ in range(2):  # training goes on until the kill lands
        t.train_step()
        async_save.maybe_finalize(t)
    async_save.maybe_finalize(t, blocking=True)
    raise AssertionError("the writer should have killed this process")


def test_kill_during_async_write_resumes_from_previous(tmp_path):
    with pytest.raises(RankFailed, match="died"):
        run_distributed(_killed_mid_write, 1, str(tmp_path), {})
    assert read_tracker(str(tmp_path)) == HALF
    doomed = os.path.join(tmp_path, f"iter_{HALF + 1:07d}")
    assert os.path.exists(os.path.join(doomed, MARKER)) and not os.path.exists(os.path.join(doomed, MANIFEST))
    ref = run_distributed(straight, 1, {})
    # the resumed job writes the same --save: it loads HALF and removes the unfinished folder
    resumed = run_distributed(_resume_writing, 1, str(tmp_path), {})
    assert not os.path.exists(doomed)
    (a, ca), (b, cb) = ref[0], resumed[0]
    assert ca == cb and all(torch.equal(a[n][0], b[n][0]) for n in a)


def _resume_writing(rank, world, ckpt, kw):
    cfg = resume_cfg(world, ckpt, load=ckpt, **kw)
    t = make_trainer(cfg)
    assert torch_format.load_checkpoint(t) and t.iteration == HALF
    t.train()
    return shards(t), t.consumed_samples


def _second_save_waits(rank, world, ckpt, kw):
    """A save while another is in flight waits for it and names it first; each save's
    stall is the gather and host copy only (recorded, not timed here)."""
    t = _async_trainer(world, ckpt, kw)
    gate = threading.Event()
    torch_format.write_rank_file = _gated_writer(gate)
    async_save.save_checkpoint_async(t)
    first = getattr(t, async_save.ATTR)
    t.train_step()
    threading.Timer(0.5, gate.set).start()  # released while the second save waits on it
    async_save.save_checkpoint_async(t)
    assert not first.thread.is_alive() and read_tracker(ckpt) == HALF
    async_save.maybe_finalize(t, blocking=True)
    assert read_tracker(ckpt) == HALF + 1
    return True


def test_second_save_waits_for_the_first(tmp_path):
    run_distributed(_second_save_waits, 2, str(tmp_path), dict(pp=2))


def test_host_copy_is_a_copy_and_keeps_sharing():
    w = torch.ones(3)
    from collections import OrderedDict
    sd = OrderedDict(a=w, b=w, n=[1, (w, "x")])
    sd._metadata = {"": {"version": 1}}
    c = async_save.host_copy(sd)
    w.add_(1)
    assert torch.equal(c["a"], torch.ones(3)) and c["a"] is c["b"] and c["n"][1][0] is c["a"]
    assert isinstance(c, OrderedDict) and c._metadata == sd._metadata



def _interrupted_mid_write(rank, world, ckpt, kw):
    """Ctrl-C while the last rank's writer is still busy: no collective; each rank finishes its
    file and rank 0 names the checkpoint once every rank's checksum is there."""
    t = _async_trainer(world, ckpt, kw)
    gate = threading.Event()
    if rank == world - 1:
        torch_format.write_rank_file = _gated_writer(gate)
        threading.Timer(0.5, gate.set).start()  # the write ends while rank 0 waits for its checksum
    async_save.save_checkpoint_async(t)
    async_save.finish_after_interrupt(t)  # (what run_pretraining does after KeyboardInterrupt)
    assert getattr(t, async_save.ATTR) is None
    return read_tracker(ckpt)


def test_ctrl_c_finishes_and_names_the_save_in_flight(tmp_path):
    assert run_distributed(_interrupted_mid_write, 2, str(tmp_path), dict(pp=2))[0] == HALF
    assert os.path.exists(os.path.join(tmp_path, f"iter_{HALF:07d}", MANIFEST))

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
        "--mock-data", "--vocab-size", "100", "--micro-batch-size", "1", "--train-iters", "2"]


@pytest.mark.parametrize("fmt", ["torch_dist", "megatron-legacy"])
def test_other_formats_are_refused_in_one_line(fmt, tmp_path, capsys):
    from megatron.cli.arguments import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(TINY + ["--save", str(tmp_path), "--ckpt-format", fmt, "--async-save"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--async-save" in err[0] and "--ckpt-format torch" in err[0]
    cfg = parse_args(TINY + ["--save", str(tmp_path), "--async-save"], world_size=1)
    assert cfg.checkpoint.async_save and cfg.checkpoint.ckpt_format == "torch"
