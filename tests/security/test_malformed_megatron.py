"""Malformed Megatron-LM files (issue 48): each is one line naming the file and the field, raised as
the reader's own error type (MegatronCheckpointError, or UnsafeCheckpointError for what a file
may not hold), never a traceback from deep inside torch or numpy. The files start as what
Megatron-LM itself wrote (tests/fixtures/megatron) and get one field edited."""
from __future__ import annotations

import argparse
import enum
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from megatron.checkpointing import megatron_optim
from megatron.checkpointing.megatron_base import MegatronCheckpointError
from megatron.checkpointing.safety import UnsafeCheckpointError, _arrays

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")
ERRORS = (MegatronCheckpointError, UnsafeCheckpointError)


def _copy(tmp_path, name):
    root = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), root)
    return str(root)


def _rank_file(root, sub="mp_rank_00"):
    return os.path.join(root, "iter_0000003", sub, "model_optim_rng.pt")


def _edit(path, fn):
    state = L.safe_load_megatron(path)
    fn(state)
    with _as_megatron_core(L.ModelType):
        torch.save(state, path)


class _as_megatron_core:
    """While saving: `enum_cls` pickles under Megatron-Core's module name, as Megatron-LM's files
    name args.model_type (the reader maps that name to its own enum)."""

    def __init__(self, enum_cls):
        self.cls = enum_cls

    def __enter__(self):
        self.old = self.cls.__module__, self.cls.__qualname__
        mod = types.ModuleType("megatron.core.enums")
        mod.ModelType = self.cls
        self.cls.__module__, self.cls.__qualname__ = "megatron.core.enums", "ModelType"
        sys.modules["megatron.core.enums"] = mod

    def __exit__(self, *exc):
        self.cls.__module__, self.cls.__qualname__ = self.old
        sys.modules.pop("megatron.core.enums", None)


def _one_line(e, *names):
    msg = str(e.value)
    assert "\n" not in msg.strip(), msg
    for n in names:
        assert n in msg, msg
    return msg


class _FakeShape:
    """Pickles as numpy's own array reconstruction with a 2^40-element shape and no data."""

    def __reduce__(self):
        mod = getattr(np, "_core", None) or np.core
        return (mod.multiarray._reconstruct, (np.ndarray, (0,), b"b"),
                (1, (1 << 40,), np.dtype(np.uint8), False, b""))


class _Bogus(enum.Enum):
    bogus = 999


def _model_type_999(path):
    """args.model_type as Megatron-Core's enum with a value it does not have."""
    state = L.safe_load_megatron(path)
    state["args"].model_type = _Bogus.bogus
    with _as_megatron_core(_Bogus):
        torch.save(state, path)


# (case, edit of the rank file, what the line names)
RANK_FILE_CASES = [
    ("truncated rank file", lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2),
     "not a readable Megatron-LM checkpoint"),
    ("empty rank file", lambda p: open(p, "w").close(), "not a readable Megatron-LM checkpoint"),
    ("string iteration", lambda p: _edit(p, lambda s: s.__setitem__("iteration", "3")), "field iteration"),
    ("string consumed_train_samples",
     lambda p: _edit(p, lambda s: setattr(s["args"], "consumed_train_samples", "many")),
     "args.consumed_train_samples"),
    ("missing num_layers", lambda p: _edit(p, lambda s: delattr(s["args"], "num_layers")), "args.num_layers"),
    ("ModelType(999)", _model_type_999, "not a readable Megatron-LM"),
    ("numpy shape 2^40", lambda p: _edit(p, lambda s: s.__setitem__("extra", _FakeShape())), "the file"),
    ("object array in a SimpleNamespace",
     lambda p: _edit(p, lambda s: s.__setitem__("extra", types.SimpleNamespace(
         a=np.array([argparse.Namespace(), 1], dtype=object)))), "refused"),
]


@pytest.mark.parametrize("case,edit,expect", RANK_FILE_CASES, ids=[c[0] for c in RANK_FILE_CASES])
def test_malformed_rank_file_is_one_line(tmp_path, case, edit, expect):
    root = _copy(tmp_path, "legacy_gpt_tp1")
    path = _rank_file(root)
    edit(path)
    with pytest.raises(ERRORS) as e:
        L.read_full(root)
    _one_line(e, path, expect)


def test_tp_shards_of_different_widths_are_one_line(tmp_path):
    root = _copy(tmp_path, "mcore_gpt_tp2")
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    _edit(_rank_file(root, "mp_rank_01"), lambda s: s["model"].__setitem__(key, s["model"][key][:, :-1].clone()))
    with pytest.raises(MegatronCheckpointError) as e:
        L.read_full(root)
    _one_line(e, "do not join", "dense_h_to_4h")


def _distrib(root):
    return os.path.join(root, "iter_0000003", "mp_rank_00", "distrib_optim.pt")


def _buffer_edit(fn):
    def edit(path):
        state = L.safe_load_megatron(path)
        flat = next(iter(state[0].values()))
        fn(flat)
        torch.save(state, path)
    return edit


DISTRIB_CASES = [
    ("2-D buffers", _buffer_edit(lambda f: f.update({k: f[k].view(2, -1) for k in ("param", "exp_avg", "exp_avg_sq")})),
     "not flat"),
    ("string numel_unpadded", _buffer_edit(lambda f: f.__setitem__("numel_unpadded", "21504")), "numel_unpadded"),
    ("list buffer", _buffer_edit(lambda f: f.__setitem__("param", f["param"].tolist()[:4])), "grad buffer"),
]


@pytest.mark.parametrize("case,edit,expect", DISTRIB_CASES, ids=[c[0] for c in DISTRIB_CASES])
def test_malformed_distrib_optim_is_one_line(tmp_path, case, edit, expect):
    root = _copy(tmp_path, "distopt_gpt_dp2")
    edit(_distrib(root))
    with pytest.raises(MegatronCheckpointError) as e:
        L.read_full(root, on_state=megatron_optim.Collector())
    _one_line(e, _distrib(root), expect)


@pytest.mark.parametrize("bad", [{"random_rng_state": "not a state"}, {"np_rng_state": (1, 2)}, "a string"])
def test_bad_rng_state_is_one_line(bad):
    st = L.safe_load_megatron(_rank_file(os.path.join(FIX, "distopt_gpt_dp2")))["rng_state"][0]
    rng = [dict(st, **bad)] if isinstance(bad, dict) else [bad]
    before = torch.get_rng_state()
    try:
        with pytest.raises(MegatronCheckpointError) as e:
            megatron_optim.set_rng(rng, argparse.Namespace(), types.SimpleNamespace(dp_rank=0), "cpu")
        _one_line(e, "rng_state[0]", "--no-load-rng")
    finally:
        torch.set_rng_state(before)


def test_string_global_batch_size_is_one_line():
    with pytest.raises(MegatronCheckpointError) as e:
        L.count_field("ck", "args.global_batch_size", "16")
    _one_line(e, "ck", "args.global_batch_size")


def test_allowlist_walk_is_iterative_and_covers_simple_namespace():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert list(_arrays({"x": deep})) == []
    found = list(_arrays({"args": types.SimpleNamespace(a=np.zeros(2, dtype=object))}))
    assert len(found) == 1 and found[0][1].dtype == object


def test_a_failed_megatron_save_names_what_was_kept(tmp_path):
    """The line a failing --ckpt-format megatron-legacy save stops the run with (the tracker moves
    last, so the checkpoint it names is the one kept)."""
    from megatron.checkpointing.megatron_write import save_failed
    from megatron.checkpointing.torch_format import read_tracker
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    ps = types.SimpleNamespace(describe=lambda: "rank 0 (tp 0/1, pp 0/2, dp 0/1)")
    msg = save_failed(ps, str(tmp_path), 6, KeyError("output_layer.weight"), read_tracker)
    assert "\n" not in msg and "could not save iteration 6" in msg and "(iteration 5) is intact" in msg, msg
