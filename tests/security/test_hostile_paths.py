"""Every reader against every path trick (issue 48): a link out of the checkpoint folder (rank file,
iteration folder, release folder, distrib_optim.pt, .sha256, config.json), a manifest naming
`../..` or `/dev/zero`, a tracker that is a FIFO or a link to `/dev/zero`. Each cell must be
refused in one line naming the path, without hanging and without reading outside the folder.

Readers run in a worker thread: a reader that blocks (a FIFO opened for reading) or reads
forever (`/dev/zero`) shows up as a thread still alive after HANG_S, reported as a hang with the
cell's name (the FIFO is then opened for writing to release it). The table printed by
`python tests/security/test_hostile_paths.py` is docs/hostile_inputs.md's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import threading

import numpy as np
import pytest
import torch

from megatron.checkpointing import mcore_dist, megatron_legacy, megatron_optim, torch_format
from megatron.checkpointing.torch_format import load_checkpoint

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")
HANG_S = 30.0  # a hang detector only: every refusal here takes milliseconds
TRACKER = "latest_checkpointed_iteration.txt"


# ---- the readers ---------------------------------------------------------------------------
def _load(rank, world, roots):
    """`load_checkpoint` (what --load runs) on each folder of `roots`: {root: its error or None}."""
    from tests.resume_harness import make_trainer, resume_cfg
    out = {}
    for root, fmt in roots:
        t = make_trainer(resume_cfg(world, load=root, iters=1, fmt=fmt))
        try:
            load_checkpoint(t)
            out[root] = None
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            out[root] = f"{type(e).__name__}: {e}"
        finally:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


_LOADED: dict = {}


def _torch_format(root):
    """This project's torch and torch_dist formats through `load_checkpoint` itself: every such
    cell ran in one spawned rank (`loaded_cells`, a 120 s hang detector); here its recorded answer."""
    msg = _LOADED[root]
    if msg is None:
        return
    raise ValueError(msg.split(": ", 1)[1] if msg.startswith(("CheckpointError", "ValueError")) else msg)


_torch_dist = _torch_format


def _megatron_legacy(root):
    megatron_legacy.read_full(root)


def _megatron_optim(root):
    megatron_legacy.read_full(root, on_state=megatron_optim.Collector())


def _mcore_dist(root):
    mcore_dist.read_full(root)


def _hf(root):
    pytest.importorskip("safetensors")
    from tools.checkpoint import hf_gpt2
    hf_gpt2.load_hf(root)


def _data(root):
    from megatron.data.indexed_dataset import IndexedDataset
    IndexedDataset(os.path.join(root, "text")).get(0)


# ---- the folders they read -----------------------------------------------------------------
def _copy(name, dst):
    shutil.copytree(os.path.join(FIX, name), dst, ignore=shutil.ignore_patterns("logits.pt", "step4.pt"))
    return str(dst)


def make_sources(d) -> dict:
    """Genuine folders of each format under `d` (the project's torch and torch_dist saved by a
    trainer run, Megatron's written by Megatron-LM itself: tests/fixtures/megatron)."""
    from tests.dist_harness import run_distributed
    out = {"torch": str(d / "torch"), "torch_dist": str(d / "torch_dist")}
    for fmt in ("torch", "torch_dist"):
        run_distributed(_save, 1, out[fmt], fmt, timeout_s=120.0)
    out["megatron"] = _copy("legacy_gpt_tp1", d / "megatron")
    out["distopt"] = _copy("distopt_gpt_dp2", d / "distopt")
    out["mcore_dist"] = _copy("mcore_gpt_dist_tp1", d / "mcore_dist")
    hf = d / "hf"
    hf.mkdir()
    from safetensors.torch import save_file
    save_file({"wte.weight": torch.zeros(32, 16)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 16, "vocab_size": 32}))
    out["hf"] = str(hf)
    data = d / "data"
    data.mkdir()
    from megatron.data.indexed_dataset import IndexedDatasetBuilder
    b = IndexedDatasetBuilder(str(data / "text.bin"), dtype=np.uint16)
    b.add_document(np.arange(8, dtype=np.uint16), [8])
    b.finalize(str(data / "text.idx"))
    out["data"] = str(data)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("sources"))


def prepare(sources, base) -> dict:
    """{case index: (root, outside)} with each case's trick applied; the torch and torch_dist
    cells then loaded by `load_checkpoint` in one spawned rank (results in `_LOADED`)."""
    from tests.dist_harness import run_distributed
    out, loads = {}, []
    for i, (label, source, reader, trick, _) in enumerate(CASES):
        root, outside = os.path.join(base, f"c{i}", "ck"), os.path.join(base, f"c{i}", "outside")
        os.makedirs(outside)
        shutil.copytree(sources[source], root, symlinks=True)
        trick(root, outside)
        out[i] = root
        if reader is _torch_format:
            loads.append((root, source))
    _LOADED.update(run_distributed(_load, 1, loads, timeout_s=120.0)[0])
    return out


@pytest.fixture(scope="module")
def cells(sources, tmp_path_factory):
    return prepare(sources, str(tmp_path_factory.mktemp("cells")))


def _save(rank, world, root, fmt):
    from tests.resume_harness import make_trainer, resume_cfg
    t = make_trainer(resume_cfg(world, save=root, iters=1, fmt=fmt))
    t.train()
    torch_format.save_checkpoint(t)


# ---- the tricks ----------------------------------------------------------------------------
def _it_dir(root):
    text = open(os.path.join(root, TRACKER)).read().strip()
    return os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}")


def _rank_file(root):
    it = _it_dir(root)
    for dirpath, _, files in sorted(os.walk(it)):
        for f in sorted(files):
            if f in ("model_optim_rng.pt", "model_rng.pt"):
                return os.path.join(dirpath, f)
    raise AssertionError(f"no rank file under {it}")


def _link_out(path, outside):
    """Replace `path` by a link to a copy of it outside the folder (what a careless `ln -s` does)."""
    copy = os.path.join(outside, os.path.basename(path) + ".elsewhere")
    (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, copy)
    (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
    os.symlink(copy, path)


def tracker_fifo(root, outside):
    os.remove(os.path.join(root, TRACKER))
    os.mkfifo(os.path.join(root, TRACKER))


def tracker_dev_zero(root, outside):
    os.remove(os.path.join(root, TRACKER))
    os.symlink("/dev/zero", os.path.join(root, TRACKER))


def rank_file_link(root, outside):
    _link_out(_rank_file(root), outside)


def sha256_link(root, outside):
    _link_out(_rank_file(root) + ".sha256", outside)


def iter_dir_link(root, outside):
    _link_out(_it_dir(root), outside)


def release_dir_link(root, outside):
    it = _it_dir(root)
    os.rename(it, os.path.join(outside, "release"))
    os.symlink(os.path.join(outside, "release"), os.path.join(root, "release"))
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("release")


def distrib_optim_link(root, outside):
    _link_out(os.path.join(os.path.dirname(_rank_file(root)), "distrib_optim.pt"), outside)


def _manifest_naming(target):
    def trick(root, outside):
        it = _it_dir(root)
        rel = os.path.relpath(_rank_file(root), it)
        path = os.path.join(it, "manifest.json")
        digest = hashlib.sha256(open(_rank_file(root), "rb").read()).hexdigest()
        files = json.load(open(path))["files"] if os.path.exists(path) else {rel: {"sha256": digest, "bytes": 1}}
        files[target] = {"sha256": "0" * 64, "bytes": 1}
        with open(path, "w") as f:
            json.dump({"files": files}, f)
    return trick


def metadata_json_dev_zero(root, outside):
    path = os.path.join(_it_dir(root), "metadata.json")
    os.remove(path)
    os.symlink("/dev/zero", path)


def common_json_fifo(root, outside):
    path = os.path.join(_it_dir(root), "common.json")
    os.remove(path)
    os.mkfifo(path)


def config_json_dev_zero(root, outside):
    os.remove(os.path.join(root, "config.json"))
    os.symlink("/dev/zero", os.path.join(root, "config.json"))


def config_json_fifo(root, outside):
    os.remove(os.path.join(root, "config.json"))
    os.mkfifo(os.path.join(root, "config.json"))


def safetensors_link(root, outside):
    _link_out(os.path.join(root, "model.safetensors"), outside)


def idx_fifo(root, outside):
    os.remove(os.path.join(root, "text.idx"))
    os.mkfifo(os.path.join(root, "text.idx"))


def bin_dev_zero(root, outside):
    os.remove(os.path.join(root, "text.bin"))
    os.symlink("/dev/zero", os.path.join(root, "text.bin"))


# (reader label, source folder, reader, trick, what the one line must say)
LINK, SPECIAL, OUTSIDE = "symbolic link", "not a regular file", "outside the folder"
CASES = [
    ("torch", "torch", _torch_format, tracker_fifo, SPECIAL),
    ("torch", "torch", _torch_format, tracker_dev_zero, LINK),
    ("torch", "torch", _torch_format, rank_file_link, LINK),
    ("torch", "torch", _torch_format, sha256_link, LINK),
    ("torch", "torch", _torch_format, iter_dir_link, LINK),
    ("torch_dist", "torch_dist", _torch_dist, common_json_fifo, SPECIAL),
    ("torch_dist", "torch_dist", _torch_dist, iter_dir_link, LINK),
    ("Megatron legacy", "megatron", _megatron_legacy, tracker_fifo, SPECIAL),
    ("Megatron legacy", "megatron", _megatron_legacy, tracker_dev_zero, LINK),
    ("Megatron legacy", "megatron", _megatron_legacy, rank_file_link, LINK),
    ("Megatron legacy", "megatron", _megatron_legacy, iter_dir_link, LINK),
    ("Megatron legacy", "megatron", _megatron_legacy, release_dir_link, LINK),
    ("Megatron legacy", "megatron", _megatron_legacy, _manifest_naming("../../../../etc/hostname"), OUTSIDE),
    ("Megatron legacy", "megatron", _megatron_legacy, _manifest_naming("../../../../no/such/file"), OUTSIDE),
    ("Megatron legacy", "megatron", _megatron_legacy, _manifest_naming("/dev/zero"), OUTSIDE),
    ("Megatron legacy", "megatron", _megatron_legacy, _manifest_naming("mp_rank_00/../../../x"), OUTSIDE),
    ("distrib_optim.pt", "distopt", _megatron_optim, distrib_optim_link, LINK),
    ("Megatron-Core torch_dist", "mcore_dist", _mcore_dist, tracker_fifo, SPECIAL),
    ("Megatron-Core torch_dist", "mcore_dist", _mcore_dist, iter_dir_link, LINK),
    ("Megatron-Core torch_dist", "mcore_dist", _mcore_dist, metadata_json_dev_zero, LINK),
    ("HF folder", "hf", _hf, config_json_dev_zero, LINK),
    ("HF folder", "hf", _hf, config_json_fifo, SPECIAL),
    ("HF folder", "hf", _hf, safetensors_link, LINK),
    ("data index", "data", _data, idx_fifo, SPECIAL),
    ("data index", "data", _data, bin_dev_zero, SPECIAL),
]


def _name(trick) -> str:
    if trick.__name__ == "trick":
        return "manifest lists " + trick.__closure__[0].cell_contents
    return trick.__name__.replace("_", " ")


def _release_fifos(root):
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.exists(p) and not os.path.islink(p) and stat.S_ISFIFO(os.stat(p).st_mode):
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)


def refusal(reader, root) -> str:
    """The reader's error on `root` as one string; fails on a hang, an acceptance or a traceback-
    worthy error type."""
    out = {}

    def work():
        try:
            reader(root)
            out["accepted"] = True
        except BaseException as e:  # noqa: BLE001 - the cell records what the reader raised
            out["error"] = e

    th = threading.Thread(target=work, daemon=True)
    th.start()
    th.join(HANG_S)
    if th.is_alive():
        _release_fifos(root)
        pytest.fail(f"the reader hung (still reading after {HANG_S:.0f} s): no refusal before the read")
    if out.get("accepted"):
        pytest.fail("the reader accepted the folder: it read through the trick")
    e = out["error"]
    assert isinstance(e, (OSError, ValueError, RuntimeError)) and not isinstance(e, (RecursionError, MemoryError)), \
        f"{type(e).__name__}: {e}"
    return str(e)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{_name(c[3])}" for c in CASES])
def test_trick_is_refused_in_one_line(cells, case):
    label, source, reader, trick, expect = CASES[case]
    root = cells[case]
    msg = refusal(reader, root)
    assert "\n" not in msg.strip(), f"more than one line: {msg}"
    assert expect in msg, msg
    assert root in msg, f"the line does not name the path: {msg}"


def test_no_existence_oracle_for_files_outside(sources, tmp_path):
    """A manifest naming an outside file that exists and one that does not get the same answer."""
    msgs = []
    for i, target in enumerate(("../../../../etc/hostname", "../../../../etc/no-such-file-here")):
        root = tmp_path / f"ck{i}"
        shutil.copytree(sources["megatron"], root)
        _manifest_naming(target)(str(root), str(tmp_path))
        msgs.append(refusal(_megatron_legacy, str(root)).replace(str(root), "ROOT").replace(target, "TARGET"))
    assert msgs[0] == msgs[1], msgs


def test_hf_sizes_beyond_the_weights_are_refused_before_anything_is_built(sources, tmp_path):
    """Size fields just under the 2^24 cap beside a tiny model.safetensors: --verify (or
    transformers) would build a model of gigabytes from them; the config must describe the file."""
    root = tmp_path / "hf"
    shutil.copytree(sources["hf"], root)
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": (1 << 24) - 8, "n_head": 8,
                                                  "n_layer": 4, "vocab_size": 32}))
    msg = refusal(_hf, str(root))
    assert "describe at least" in msg and "model.safetensors holds 512" in msg and "\n" not in msg, msg


def table(results) -> str:
    """docs/hostile_inputs.md's table from {(reader, trick): message}."""
    lines = ["| trick | reader | result | the line (abridged) |", "|---|---|---|---|"]
    for (label, trick), msg in results.items():
        short = msg.replace("|", "/")
        short = short if len(short) < 140 else short[:137] + "..."
        lines.append(f"| {trick} | {label} | refused in one line | `{short}` |")
    return "\n".join(lines)


if __name__ == "__main__":  # print the table for docs/hostile_inputs.md (each cell measured here)
    import tempfile

    from pathlib import Path
    srcs = make_sources(Path(tempfile.mkdtemp(prefix="sources")))
    base = tempfile.mkdtemp()
    roots = prepare(srcs, base)
    res = {}
    for i, (label, source, reader, trick, expect) in enumerate(CASES):
        msg = refusal(reader, roots[i])
        assert expect in msg and "\n" not in msg.strip(), msg
        res[(label, _name(trick))] = msg.replace(base, "<tmp>")
    print(table(res))
    sys.exit(0)
