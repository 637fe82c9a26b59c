"""megatron.atomic: the target holds its old content or the whole new one; no temporary is left."""
import json
import os
import stat

import numpy as np
import pytest

from megatron.atomic import atomic_open, atomic_path, write_json, write_text


class Boom(Exception):
    pass


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_success_replaces_and_leaves_only_the_target(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    write_json(target, {"a": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    assert target.read_text().endswith("\n")
    assert os.listdir(tmp_path) == ["out.json"]


@pytest.mark.parametrize("how", ["open", "path"])
def test_failure_keeps_the_old_content_and_removes_the_temporary(tmp_path, how):
    target = tmp_path / "t.txt"
    target.write_text("old content")
    with pytest.raises(Boom):
        if how == "open":
            with atomic_open(target, "w") as f:
                f.write("half of the new")
                raise Boom
        else:
            with atomic_path(target) as tmp:
                with open(tmp, "w") as f:
                    f.write("half of the new")
                raise Boom
    assert target.read_text() == "old content"
    assert os.listdir(tmp_path) == ["t.txt"]


def test_failure_without_a_target_creates_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C mid-write cleans up too
        with atomic_open(tmp_path / "new.bin", "wb") as f:
            f.write(b"x")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_temporary_lives_beside_the_target_with_the_given_name(tmp_path):
    with atomic_path(tmp_path / "a.npy", suffix=".tmp.npy") as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith("a.npy.")
        np.save(tmp, np.arange(3))  # keeps the name: it already ends in .npy
    assert np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    with atomic_open(tmp_path / "c.pt", "wb", suffix="", prefix=".tmp-host-42-", fsync=True) as f:
        f.write(b"payload")
        name = next(n for n in os.listdir(tmp_path) if n.startswith(".tmp-"))
    assert name.startswith(".tmp-host-42-") and len(name) == len(".tmp-host-42-") + 8
    assert (tmp_path / "c.pt").read_bytes() == b"payload"
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "c.pt"]


def test_default_mode_is_what_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        write_text(tmp_path / "x", "1")
        with atomic_path(tmp_path / "y"):
            pass
        with open(tmp_path / "plain", "w") as f:
            f.write("1")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "x") == _mode(tmp_path / "y") == _mode(tmp_path / "plain") == 0o640


def test_explicit_mode_ignores_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_json(tmp_path / "cal.json", {}, mode=0o644)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "cal.json") == 0o644


def test_only_write_modes():
    with pytest.raises(ValueError, match="mode"):
        with atomic_open("x", "a"):
            pass
