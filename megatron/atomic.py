"""Atomic file writes: the target holds either its old content or the complete new one, never half a file.

Every writer stages the new content in a temporary file in the target's folder (a rename is atomic
only within one file system) and renames it over the target when the write succeeded; on any
error, Ctrl-C included, the temporary file is removed and the target is untouched.

The temporary file is created with the mode an ordinary `open(path, "w")` would give it (0o666
less the umask), unlike `tempfile.mkstemp`'s owner-only 0o600: the result is usually a shared
artifact (a cost table, a trace, a checkpoint). `mode=` sets an exact mode instead.
"""
import contextlib
import json
import os
import secrets
from typing import Iterator, Optional

__all__ = ["atomic_path", "atomic_open", "write_text", "write_json", "fsync_dir"]


def fsync_dir(folder: str) -> None:
    """Make a rename in `folder` durable (where the platform and file system allow it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create(path: str, suffix: str, mode: Optional[int], prefix: Optional[str]):
    folder = os.path.dirname(os.path.abspath(path))
    head = os.path.join(folder, os.path.basename(path) + "." if prefix is None else prefix)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = f"{head}{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(tmp, flags, 0o666 if mode is None else mode)  # the kernel applies the umask
        except FileExistsError:
            continue
        if mode is not None:
            try:
                os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
        return fd, tmp, folder
    raise FileExistsError(f"{path}: no free temporary name after 100 tries (folder full of '{head}*{suffix}' files?)")


@contextlib.contextmanager
def _staged(path, suffix, mode, prefix, fsync) -> Iterator[tuple]:
    path = os.fspath(path)
    fd, tmp, folder = _create(path, suffix, mode, prefix)
    try:
        yield fd, tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(folder)


@contextlib.contextmanager
def atomic_path(path, suffix: str = ".tmp", mode: Optional[int] = None, fsync: bool = False,
                prefix: Optional[str] = None) -> Iterator[str]:
    """Yield the name of a new empty file beside `path` for a writer that wants a file name
    (`np.save`, a profiler's exporter); rename it over `path` when the block succeeds.

    The name is `<prefix><random><suffix>` in `path`'s folder, the prefix defaulting to
    `<basename of path>.`; `suffix` must be what the writer keeps (`np.save` appends `.npy`
    to any other name). `fsync` flushes the file before the rename and the folder after it.
    """
    with _staged(path, suffix, mode, prefix, fsync) as (fd, tmp):
        os.close(fd)
        yield tmp
        if fsync:
            sync = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(sync)
            finally:
                os.close(sync)


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", suffix: str = ".tmp", file_mode: Optional[int] = None,
                fsync: bool = False, prefix: Optional[str] = None, **open_kwargs):
    """`open(path, mode)` ("w" or "wb") that replaces `path` only when the block succeeds."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    with _staged(path, suffix, file_mode, prefix, fsync) as (fd, tmp):
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def write_text(path, text: str, *, mode: Optional[int] = None, fsync: bool = False) -> None:
    """Atomically replace `path` with `text`."""
    with atomic_open(path, "w", file_mode=mode, fsync=fsync) as f:
        f.write(text)


def write_json(path, obj, *, end: str = "\n", mode: Optional[int] = None, fsync: bool = False,
               **dumps_kwargs) -> None:
    """Atomically replace `path` with `json.dumps(obj, **dumps_kwargs) + end`."""
    write_text(path, json.dumps(obj, **dumps_kwargs) + end, mode=mode, fsync=fsync)
